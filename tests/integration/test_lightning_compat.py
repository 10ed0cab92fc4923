"""Lightning's checkpointing flows with ``UringCheckpointIO`` as the default IO (issue 14), marker ``lightning_compat``.

Every test runs once per default IO (``MODES``):

* ``stock``: Lightning's own ``TorchCheckpointIO`` (no plugin passed: the real default). The baseline: every
  assertion below holds for it.
* ``sync``: ``UringCheckpointIO()``.
* ``async``: ``AsyncUringCheckpointIO()`` (wrapping a ``UringCheckpointIO()``) with its default ``eager_bytes``
  (1 MiB). The wrapper's saves *are* lazy snapshots; with these tiny models every tensor is below ``eager_bytes``, so
  it is copied inside ``save_checkpoint`` and only the write is in the background.
* ``lazy``: ``AsyncUringCheckpointIO(eager_bytes=0)``: every tensor is only referenced at save time
  and copied later by the background copier (what large tensors get in ``async``), so the snapshot really is
  lazy here.

Where the flow allows it, the same scenario also runs with the stock IO in a sibling directory and the file
listings and the checkpoints' contents must equal the stock run's (the runs are seeded and deterministic). In the
asynchronous modes the tests slow the background work down (``_slow_background``) so that saves are still in
flight when Lightning looks at the directory, loads, removes or changes parameters.

Written for this project from the behaviours Lightning's own tests check (ModelCheckpoint, checkpoint connector,
CheckpointIO plugins, trainer checkpointing, torch saving, Fabric strategy save/load); no code is taken from them.
The numbered items of issue 14 are named in the tests' docstrings.
"""

from __future__ import annotations

import copy
import errno
import io as _bytes_io
import os
import pickle
import re
import threading
import time
import uuid
import warnings
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_recover.checkpoint import AsyncCheckpointError
from lightning_recover.checkpoint.file import async_io
from lightning_recover.checkpoint.file.torch_zip import PlanWriter
from lightning_recover.lightning.checkpoint_io import AsyncUringCheckpointIO, UringCheckpointIO
from tests.compare import checkpoint_io_config
from tests.jobs import bounded

# Lightning Trainer fits (149 of them): the slow suite (make test), not the edit loop (make test-fast)
pytestmark = [pytest.mark.lightning_compat, pytest.mark.slow, pytest.mark.timeout(120)]

MODES = ["stock", "sync", "async", "lazy"]
PLUGIN_MODES = ["sync", "async", "lazy"]
ASYNC_MODES = ("async", "lazy")


def make_io(mode: str):
    if mode == "stock":
        return TorchCheckpointIO()
    if mode == "sync":
        return UringCheckpointIO()
    if mode == "async":
        return AsyncUringCheckpointIO()
    if mode == "lazy":
        return AsyncUringCheckpointIO(eager_bytes=0)
    raise ValueError(mode)


def _plugins(mode: str) -> list:
    """``Trainer``/``Fabric`` ``plugins``: nothing for the stock IO (Lightning's default), else the plugin."""
    return [] if mode == "stock" else [make_io(mode)]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", ".*(does not have many workers|exists and is not empty|LitLogger|litmodels).*"
        )
        warnings.filterwarnings("ignore", category=UserWarning, module="lightning")
        yield


@pytest.fixture(autouse=True)
def _deterministic_threads():
    """The stock-vs-plugin content comparisons need bitwise identical runs."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ----------------------------------------------------------------------------------------------- helpers


def _clone(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(v) for v in obj)
    return obj


def _assert_same(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.cpu(), b.cpu()), f"tensor {where} differs"
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{where}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"
        for k in a:
            _assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}/{i}")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


_COMPARED = (
    "state_dict",
    "optimizer_states",
    "lr_schedulers",
    "epoch",
    "global_step",
    "loops",
    "hyper_parameters",
    "current_model_state",
)


def _assert_same_checkpoint(a: dict, b: dict, where: str) -> None:
    """Equal in everything but paths (ModelCheckpoint's state names its directory)."""
    assert {k for k in a if k in _COMPARED} == {k for k in b if k in _COMPARED}, where
    for k in _COMPARED:
        if k in a:
            _assert_same(a[k], b[k], f"{where}:{k}")


def _tload(path, **kw) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True, **kw)


def _listing(d) -> list:
    return sorted(os.listdir(d))


def _durable(io) -> None:
    """``CheckpointIO.teardown``: a no-op for the stock IO, waits until every async save is on disk for ours."""
    _bounded(io.teardown)


def _bounded(fn, timeout: float = 60.0):
    return bounded(fn, timeout)


def _slow_background(monkeypatch, mode: str, seconds: float = 0.15) -> None:
    """Async modes: delay the copy (lazy snapshot) and the commit of every save, so that saves are in flight."""
    if mode not in ASYNC_MODES:
        return
    real_snapshot = async_io.AsyncSaver._snapshot
    real_finish = PlanWriter.finish

    def slow_snapshot(self, job, fq):
        time.sleep(seconds)
        return real_snapshot(self, job, fq)

    def slow_finish(*a, **kw):
        if threading.current_thread().name.startswith("lr-ckpt-"):  # not the synchronous saves of this test
            time.sleep(seconds)
        return real_finish(*a, **kw)

    monkeypatch.setattr(async_io.AsyncSaver, "_snapshot", slow_snapshot)
    monkeypatch.setattr(PlanWriter, "finish", slow_finish)


def _trainer(root, mode: str, **kw) -> Trainer:
    return Trainer(
        default_root_dir=root,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=_plugins(mode),
        **kw,
    )


def _data(n: int = 16, dim: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(n, dim, generator=g), torch.randn(n, 3, generator=g))


class Model(pl.LightningModule):
    """A seeded Linear regressor; remembers the checkpoint dicts as Lightning hands them to the IO."""

    def __init__(self, hidden: int = 6, lr: float = 0.1, optimizer: str = "sgd", scores=None):
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(6, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 3))
        self.saved: dict = {}

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("train_step", float(self.global_step))
        return loss

    def validation_step(self, batch, batch_idx):
        scores = self.hparams.scores
        score = scores[self.current_epoch] if scores and self.current_epoch < len(scores) else 0.0
        self.log("score", float(score))

    def on_save_checkpoint(self, checkpoint):
        # runs last in Lightning's dump_checkpoint: this is the dict the checkpoint IO gets, at save time
        self.saved[checkpoint["global_step"]] = _clone(
            {k: checkpoint[k] for k in ("state_dict", "optimizer_states", "current_model_state") if k in checkpoint}
        )

    def configure_optimizers(self):
        if self.hparams.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(_data(), batch_size=4)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(_data(4, seed=1), batch_size=4)


class ManualModel(Model):
    """Manual optimization: the optimizer step happens inside ``training_step`` (item 8)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        opt.step()
        return loss


def _params(module) -> dict:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


# ----------------------------------------------------------------- save_checkpoint / load_from_checkpoint (item 1)


@pytest.mark.parametrize("mode", MODES)
def test_save_checkpoint_then_load_from_checkpoint_and_torch_load(tmp_path, mode):
    """Item 1: ``Trainer.save_checkpoint`` files are read by ``load_from_checkpoint`` (hyper-parameters included),
    ``torch.load(weights_only=True)``, ``torch.load(mmap=True)``, the stock IO and the plugin."""
    model = Model(hidden=5, lr=0.05)
    trainer = _trainer(tmp_path, mode, max_steps=3, limit_val_batches=0)
    trainer.fit(model)
    path = tmp_path / "model.ckpt"
    trainer.save_checkpoint(path)
    _durable(trainer.strategy.checkpoint_io)

    restored = Model.load_from_checkpoint(path)
    assert dict(restored.hparams) == {"hidden": 5, "lr": 0.05, "optimizer": "sgd", "scores": None}
    _assert_same(_params(model), _params(restored), "load_from_checkpoint")

    ck = _tload(path)
    assert ck["global_step"] == 3 and ck["epoch"] == trainer.current_epoch
    _assert_same(_params(model), ck["state_dict"], "torch.load")
    _assert_same(model.saved[3]["optimizer_states"], ck["optimizer_states"], "optimizer state")
    _assert_same(ck, _tload(path, mmap=True), "mmap")
    for reader in (TorchCheckpointIO(), UringCheckpointIO()):
        _assert_same(ck, reader.load_checkpoint(path), type(reader).__name__)


# ----------------------------------------------------------------------------- fit(ckpt_path=...) resume


_RESUME_PAIRS = [("stock", "stock")] + [p for m in PLUGIN_MODES for p in (("stock", m), (m, "stock"), (m, m))]


@pytest.mark.parametrize(("writer", "reader"), _RESUME_PAIRS, ids=[f"{w}-to-{r}" for w, r in _RESUME_PAIRS])
def test_fit_resume_from_checkpoint_of_either_io(tmp_path, writer, reader):
    """Items 1/5: a checkpoint written under one IO resumes training under the other (both directions), and the
    resumed run ends bit-identical to an uninterrupted one (model, SGD momentum, loops, epoch)."""
    reference = Model()
    _trainer(tmp_path / "ref", "stock", max_epochs=3, limit_val_batches=0).fit(reference)

    first = Model()
    mc = ModelCheckpoint(dirpath=tmp_path / "ck", save_last=True)
    _trainer(tmp_path / "a", writer, max_epochs=1, limit_val_batches=0, callbacks=[mc]).fit(first)
    assert _listing(tmp_path / "ck") == ["epoch=0-step=4.ckpt", "last.ckpt"]

    resumed = Model(lr=123.0)  # the hyper-parameters of the checkpoint do not matter for fit: its state does
    t2 = _trainer(tmp_path / "b", reader, max_epochs=3, limit_val_batches=0, enable_checkpointing=False)
    t2.fit(resumed, ckpt_path=tmp_path / "ck" / "last.ckpt")
    assert (t2.global_step, t2.current_epoch) == (12, 3)
    _assert_same(_params(reference), _params(resumed), "resumed vs uninterrupted")
    _assert_same(
        reference.trainer.optimizers[0].state_dict(), t2.optimizers[0].state_dict(), "optimizer vs uninterrupted"
    )


# ------------------------------------------------------------------------------------------ ModelCheckpoint


_STOCK_RUNS: dict = {}  # (test, its parameters but the mode) -> (directory, result) of its stock-IO run


def _compare_with_stock(run, request, tmp_path, mode, subdir="ck"):
    """Run ``run(root, mode)`` for ``mode`` and for the stock IO; listings and checkpoint contents must match.

    The stock run of a test is made once and shared by its modes: it lives in a session directory
    (``tmp_path_factory``), because a passing test's own ``tmp_path`` is removed when it ends."""
    out = run(tmp_path / mode, mode)
    spec = getattr(request.node, "callspec", None)
    others = sorted((k, repr(v)) for k, v in (spec.params.items() if spec else ()) if k != "mode")
    key = (request.node.originalname, tuple(others))
    if mode == "stock":
        stock_dir, base = tmp_path / mode, out  # compared with itself: the listing and loads still run
    else:
        if key not in _STOCK_RUNS:
            shared = request.getfixturevalue("tmp_path_factory").mktemp("stock")
            _STOCK_RUNS[key] = (shared, run(shared, "stock"))
        stock_dir, base = _STOCK_RUNS[key]
    names = _listing(tmp_path / mode / subdir)
    assert names == _listing(stock_dir / subdir)
    for name in names:
        _assert_same_checkpoint(
            _tload(stock_dir / subdir / name), _tload(tmp_path / mode / subdir / name), f"{mode}/{name}"
        )
    return out, base, names


@pytest.mark.parametrize("mode", MODES)
def test_model_checkpoint_top_k_monitor_and_last(request, tmp_path, mode, monkeypatch):
    """ModelCheckpoint ``save_top_k=2`` on a monitored metric plus ``save_last``: the worse files are removed, the
    best are kept, ``last.ckpt`` is the latest saved state; ``validate(ckpt_path="best"|"last")`` loads them."""
    _slow_background(monkeypatch, mode)
    scores = [0.3, 0.9, 0.1, 0.7, 0.5]

    def run(root, m):
        model = Model(scores=scores)
        mc = ModelCheckpoint(
            dirpath=root / "ck", monitor="score", mode="max", save_top_k=2, save_last=True, filename="{epoch}"
        )
        trainer = _trainer(
            root, m, max_epochs=5, limit_train_batches=2, limit_val_batches=1, num_sanity_val_steps=0, callbacks=[mc]
        )
        trainer.fit(model)
        return model, trainer, mc

    (model, trainer, mc), _, names = _compare_with_stock(run, request, tmp_path, mode)
    assert names == ["epoch=1.ckpt", "epoch=3.ckpt", "last.ckpt"]
    ck = tmp_path / mode / "ck"
    assert mc.best_model_path == str(ck / "epoch=1.ckpt") and float(mc.best_model_score) == pytest.approx(0.9)
    assert {os.path.basename(k): round(float(v), 4) for k, v in mc.best_k_models.items()} == {
        "epoch=1.ckpt": 0.9,
        "epoch=3.ckpt": 0.7,
    }
    assert mc.last_model_path == str(ck / "last.ckpt")
    # Lightning 2.6 writes last.ckpt only along with a top-k save: here the one of epoch 3 (step 8)
    last = _tload(ck / "last.ckpt")
    assert last["global_step"] == 8
    _assert_same(model.saved[8]["state_dict"], last["state_dict"], "last.ckpt")
    for name, step in (("epoch=1.ckpt", 4), ("epoch=3.ckpt", 8)):
        got = _tload(ck / name)
        assert got["global_step"] == step
        _assert_same(model.saved[step]["state_dict"], got["state_dict"], name)

    # ckpt_path="best" / "last": Lightning resolves and loads them through the IO
    trainer.validate(model, ckpt_path="best", verbose=False)
    _assert_same(_tload(ck / "epoch=1.ckpt")["state_dict"], _params(model), "validate(best)")
    trainer.validate(model, ckpt_path="last", verbose=False)
    _assert_same(last["state_dict"], _params(model), "validate(last)")


# Lightning's test_checkpoint_callback_frequency.py counts torch.save calls (the stock IO's implementation) for these
# settings; the plugin writes through native_io, so here the default IO's save_checkpoint calls are counted instead.
SAVE_COUNTS = {  # (top-k callback?, save_last): saves for 2 epochs of 4 batches validated every 2 batches
    "default-callback": (False, False, 4),
    "top2": (True, False, 4),
    "top2-last": (True, True, 8),  # last.ckpt is written along with every top-k save
    "top2-last-link": (True, "link", 4),  # last.ckpt is a symlink to the top-k file: no save of its own
}


@pytest.mark.parametrize("case", list(SAVE_COUNTS))
@pytest.mark.parametrize("mode", MODES)
def test_save_count_per_validation_top_k_and_last(request, tmp_path, mode, case, monkeypatch):
    """Each validation check saves once through the default IO (twice with ``save_last=True``, once with
    ``save_last="link"``); the files left are the stock IO's, with the same contents."""
    _slow_background(monkeypatch, mode, seconds=0.05)
    top_k, save_last, expected = SAVE_COUNTS[case]

    def run(root, m):
        callbacks = []
        if top_k:
            callbacks.append(
                ModelCheckpoint(
                    dirpath=root / "ck", monitor="train_step", mode="max", save_top_k=2, save_last=save_last
                )
            )
        trainer = _trainer(root, m, max_epochs=2, val_check_interval=0.5, limit_val_batches=1, callbacks=callbacks)
        if not top_k:  # Lightning's default callback: root/checkpoints
            trainer.checkpoint_callback.dirpath = str(root / "ck")
        io = trainer.strategy.checkpoint_io
        calls = []
        real = io.save_checkpoint
        monkeypatch.setattr(io, "save_checkpoint", lambda *a, **kw: (calls.append(a[1]), real(*a, **kw))[1])
        trainer.fit(Model())
        _durable(io)
        return len(calls)

    count, stock_count, _ = _compare_with_stock(run, request, tmp_path, mode)
    assert count == stock_count == expected


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
@pytest.mark.parametrize("mode", MODES)
def test_every_n_train_steps_checkpoints_hold_at_save_values(request, tmp_path, mode, manual, monkeypatch):
    """``every_n_train_steps`` with ``save_top_k=-1``: one file per interval, each with exactly the model and Adam
    state at its save, while training went on (item 8: also under manual optimization)."""
    _slow_background(monkeypatch, mode)
    cls = ManualModel if manual else Model

    def run(root, m):
        model = cls(optimizer="adam")
        mc = ModelCheckpoint(dirpath=root / "ck", save_top_k=-1, every_n_train_steps=2, filename="{step}")
        _trainer(root, m, max_steps=7, limit_val_batches=0, callbacks=[mc]).fit(model)
        return model

    model, _, names = _compare_with_stock(run, request, tmp_path, mode)
    assert names == ["step=2.ckpt", "step=4.ckpt", "step=6.ckpt"]
    for step in (2, 4, 6):
        got = _tload(tmp_path / mode / "ck" / f"step={step}.ckpt")
        assert got["global_step"] == step
        _assert_same(model.saved[step]["state_dict"], got["state_dict"], f"step {step}")
        _assert_same(model.saved[step]["optimizer_states"], got["optimizer_states"], f"step {step} adam")


@pytest.mark.parametrize("mode", MODES)
def test_repeated_name_gets_version_suffix(request, tmp_path, mode, monkeypatch):
    """Item 4: a fixed ``filename`` saved repeatedly becomes ``fixed``, ``fixed-v1``, ... -- in async mode the name
    of a save still in flight counts as taken -- and a new Trainer in the same directory continues the versions."""
    _slow_background(monkeypatch, mode, seconds=0.3)

    def run(root, m):
        model = Model()
        for max_steps in (3, 2):  # a second Trainer (a rerun) in the same directory
            mc = ModelCheckpoint(
                dirpath=root / "ck",
                monitor="train_step",
                mode="max",
                save_top_k=-1,
                every_n_train_steps=1,
                filename="fixed",
            )
            _trainer(root, m, max_steps=max_steps, limit_val_batches=0, callbacks=[mc]).fit(Model())
        return model

    _compare_with_stock(run, request, tmp_path, mode)
    names = _listing(tmp_path / mode / "ck")
    assert names == ["fixed-v1.ckpt", "fixed-v2.ckpt", "fixed-v3.ckpt", "fixed-v4.ckpt", "fixed.ckpt"]
    steps = [_tload(tmp_path / mode / "ck" / n)["global_step"] for n in ("fixed.ckpt", *names[:4])]
    assert steps == [1, 2, 3, 1, 2]


@pytest.mark.parametrize("mode", MODES)
def test_hpc_checkpoint_versions_and_resume(tmp_path, mode, monkeypatch):
    """The checkpoint connector's ``hpc_ckpt_<N>`` scan finds the highest version (in-flight saves and their
    temporary files make up no version), and ``fit(ckpt_path="hpc")`` restores it through the IO."""
    _slow_background(monkeypatch, mode)

    def run(root, m):
        trainer = _trainer(root, m, max_steps=2, limit_val_batches=0, enable_checkpointing=False)
        trainer.fit(Model())
        for name in ("hpc_ckpt.ckpt", "hpc_ckpt_0.ckpt", "hpc_ckpt_3.ckpt", "hpc_ckpt_33.ckpt"):
            trainer.save_checkpoint(root / name)
        assert trainer._checkpoint_connector._hpc_resume_path == str(root / "hpc_ckpt_33.ckpt")
        _durable(trainer.strategy.checkpoint_io)
        assert _listing(root) == ["hpc_ckpt.ckpt", "hpc_ckpt_0.ckpt", "hpc_ckpt_3.ckpt", "hpc_ckpt_33.ckpt"]
        t2 = _trainer(root, m, max_steps=3, limit_val_batches=0, enable_checkpointing=False)
        resumed = Model()
        t2.fit(resumed, ckpt_path="hpc")
        assert t2.global_step == 3
        return resumed

    resumed = run(tmp_path / mode, mode)
    if mode != "stock":
        _assert_same(_params(run(tmp_path / "stock", "stock")), _params(resumed), "hpc resume vs stock IO")


@pytest.mark.parametrize("mode", ASYNC_MODES)
def test_background_threads_stop_when_a_thread_check_asks(tmp_path, mode, monkeypatch):
    """Lightning's test suite ends each test by calling ``stop()`` on every daemon thread the test left behind and
    expecting it gone. With saves still in flight the saver's threads finish those saves first: afterwards no thread
    is left and every checkpoint is complete."""
    _slow_background(monkeypatch, mode)
    before = set(threading.enumerate())
    trainer = _trainer(tmp_path, mode, max_steps=2, limit_val_batches=0, enable_checkpointing=False)
    trainer.fit(Model())
    names = [f"hpc_ckpt_{i}.ckpt" for i in range(4)]
    for name in names:
        trainer.save_checkpoint(tmp_path / name)
    left = [t for t in set(threading.enumerate()) - before if t.is_alive()]
    assert any(t.name.startswith("lr-ckpt-") for t in left), "saves were in flight when the check ran"
    for t in left:
        stop = getattr(t, "stop", None)
        assert t.daemon and callable(stop), t
        _bounded(stop)
        assert not t.is_alive(), t
    for name in names:
        assert _tload(tmp_path / name)["global_step"] == 2


# --------------------------------------------------------------------------------------------- removal (item 6)


@pytest.mark.parametrize("mode", MODES)
def test_remove_checkpoint_file_directory_and_missing(tmp_path, mode, monkeypatch):
    """Item 6: ``remove_checkpoint`` removes a file, a directory recursively (e.g. a DCP checkpoint) and accepts a
    missing path, like the stock IO; in async mode only after the saves before it are durable."""
    _slow_background(monkeypatch, mode)
    io = make_io(mode)
    io.save_checkpoint({"w": torch.arange(4.0), "k": 1}, tmp_path / "old.ckpt")
    d = tmp_path / "dcp"
    (d / "sub").mkdir(parents=True)
    (d / "sub" / "0.distcp").write_bytes(b"x" * 100)
    (d / ".metadata").write_bytes(b"m")
    io.save_checkpoint({"w": torch.arange(5.0), "k": 2}, tmp_path / "new.ckpt")
    io.remove_checkpoint(tmp_path / "old.ckpt")
    io.remove_checkpoint(d)
    io.remove_checkpoint(tmp_path / "never-existed.ckpt")
    io.remove_checkpoint(tmp_path / "no-dir" / "x.ckpt")
    _durable(io)
    assert _listing(tmp_path) == ["new.ckpt"]
    got = io.load_checkpoint(tmp_path / "new.ckpt")
    assert got["k"] == 2 and torch.equal(got["w"], torch.arange(5.0))


# ------------------------------------------------------------------------------------------- fsspec (item 3)


@pytest.mark.parametrize("mode", MODES)
def test_memory_fsspec_paths(tmp_path, mode, monkeypatch):
    """Item 3: ``memory://`` paths go through fsspec like the stock IO: ModelCheckpoint writes and removes there,
    ``fit(ckpt_path=memory://...)`` resumes from there, nothing lands on the local disk."""
    import fsspec

    monkeypatch.chdir(tmp_path)
    fs = fsspec.filesystem("memory")
    roots = {}

    def run(m):
        root = f"memory://lr-compat-{uuid.uuid4().hex}"
        roots[m] = root
        model = Model(scores=[0.1, 0.5, 0.2])
        mc = ModelCheckpoint(dirpath=f"{root}/ck", monitor="score", mode="max", save_top_k=1, save_last=True)
        trainer = _trainer(
            root, m, max_epochs=3, limit_train_batches=2, limit_val_batches=1, num_sanity_val_steps=0, callbacks=[mc]
        )
        trainer.fit(model)
        names = sorted(os.path.basename(p) for p in fs.ls(f"{root}/ck", detail=False))
        return model, trainer, names

    try:
        model, trainer, names = run(mode)
        _, _, stock_names = run("stock") if mode != "stock" else (None, None, names)
        assert names == stock_names == ["epoch=1-step=4.ckpt", "last.ckpt"]
        root = roots[mode]
        for name in names:
            with fs.open(f"{root}/ck/{name}", "rb") as f:
                ours = torch.load(f, weights_only=True)
            with fs.open(f"{roots['stock']}/ck/{name}", "rb") as f:
                theirs = torch.load(f, weights_only=True)
            _assert_same_checkpoint(theirs, ours, name)
            _assert_same(ours, trainer.strategy.checkpoint_io.load_checkpoint(f"{root}/ck/{name}"), name)
        assert ours["global_step"] == 4  # last.ckpt: written with the top-1 save of epoch 1
        _assert_same(model.saved[4]["state_dict"], ours["state_dict"], "last.ckpt")

        resumed = Model()
        t2 = _trainer(root, mode, max_epochs=4, limit_train_batches=2, limit_val_batches=0, enable_checkpointing=False)
        t2.fit(resumed, ckpt_path=f"{root}/ck/last.ckpt")
        assert t2.global_step == 8

        io = trainer.strategy.checkpoint_io
        io.remove_checkpoint(f"{root}/ck")
        assert not fs.exists(f"{root}/ck")
        assert os.listdir(tmp_path) == []  # nothing named like the URL on the local disk
    finally:
        for root in roots.values():
            if fs.exists(root):
                fs.rm(root, recursive=True)


# --------------------------------------------------------------------------------- pickle / deepcopy (item 2)


@pytest.mark.parametrize("mode", MODES)
def test_pickle_and_deepcopy_of_plugin_and_trainer(tmp_path, mode):
    """Item 2: the IO and a Trainer holding it pickle, deep-copy and ``torch.save`` (before and after saves, with
    background threads in async mode); the copies keep the configuration and save and load on their own."""
    model = Model()
    trainer = _trainer(
        tmp_path, mode, max_steps=2, limit_val_batches=0, callbacks=[ModelCheckpoint(dirpath=tmp_path / "ck")]
    )
    before = pickle.loads(pickle.dumps(trainer))  # what ddp_spawn does before fit
    assert checkpoint_io_config(before.strategy.checkpoint_io) == checkpoint_io_config(trainer.strategy.checkpoint_io)
    trainer.fit(model)
    trainer.save_checkpoint(tmp_path / "a.ckpt")  # async: engine, saver and threads exist now
    io = trainer.strategy.checkpoint_io

    buf = _bytes_io.BytesIO()
    torch.save(trainer, buf)
    buf.seek(0)
    copies = [
        torch.load(buf, weights_only=False).strategy.checkpoint_io,
        pickle.loads(pickle.dumps(trainer)).strategy.checkpoint_io,
        copy.deepcopy(trainer).strategy.checkpoint_io,
        pickle.loads(pickle.dumps(io)),
        copy.deepcopy(io),
    ]
    _durable(io)
    expected = _tload(tmp_path / "a.ckpt")
    for i, c in enumerate(copies):
        assert c is not io and checkpoint_io_config(c) == checkpoint_io_config(io)
        _assert_same(expected, c.load_checkpoint(tmp_path / "a.ckpt"), f"copy {i} load")
        c.save_checkpoint({"k": i, "w": torch.full((3,), float(i))}, tmp_path / f"c{i}.ckpt")
        _durable(c)
        got = _tload(tmp_path / f"c{i}.ckpt")
        assert got["k"] == i and torch.equal(got["w"], torch.full((3,), float(i)))


def _spawn_listing(root, mode):
    model = Model()
    mc = ModelCheckpoint(dirpath=root / "ck", save_top_k=-1, every_n_train_steps=1, filename="{step}")
    trainer = Trainer(
        default_root_dir=root,
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        max_steps=2,
        limit_val_batches=0,
        callbacks=[mc],
        plugins=_plugins(mode),
    )
    trainer.fit(model)
    return _listing(root / "ck")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["stock", "lazy"])
def test_ddp_spawn_two_processes(tmp_path, mode):
    """Item 2, for real: ``strategy="ddp_spawn"`` pickles the Trainer with its IO into 2 processes that train and
    save (rank 0). Slow (two fresh interpreters, ~15 s each run on 2 cores): only the baseline and lazy mode."""
    names = _spawn_listing(tmp_path, mode)
    assert names == ["step=1.ckpt", "step=2.ckpt"]
    ck = _tload(tmp_path / "ck" / "step=2.ckpt")
    assert ck["global_step"] == 2 and set(ck["state_dict"]) == set(Model().state_dict())


# ----------------------------------------------------------------------------------------------- Fabric


@pytest.mark.parametrize("mode", MODES)
def test_fabric_save_and_load(tmp_path, mode):
    """Fabric ``save``/``load``/``load_raw`` with the IO: model and optimizer restored in place, the remainder
    returned, ``strict=False`` for missing keys; values are those at ``save`` although training went on."""
    fabric = Fabric(accelerator="cpu", devices=1, plugins=_plugins(mode))
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = fabric.setup(model, opt)
    x, y = _data()[:]

    def step():
        opt.zero_grad()
        fabric.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()

    step()
    step()
    path = tmp_path / "fabric.ckpt"
    fabric.save(path, {"model": model, "optimizer": opt, "step": 2, "extra": torch.arange(3)})
    at_save = (_params(model), _clone(opt.state_dict()))
    step()  # training goes on while an async save may be in flight (the optimizer step waits for the snapshot)
    _durable(fabric.strategy.checkpoint_io)

    torch.manual_seed(1)
    model2 = torch.nn.Linear(6, 3)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    model2, opt2 = fabric.setup(model2, opt2)
    remainder = fabric.load(path, {"model": model2, "optimizer": opt2})
    assert set(remainder) == {"step", "extra"} and remainder["step"] == 2
    assert torch.equal(remainder["extra"], torch.arange(3))
    _assert_same(at_save[0], _params(model2), "model")
    _assert_same(at_save[1], opt2.state_dict(), "optimizer")

    state = {"model": model2, "optimizer": opt2, "step": 0, "missing": 1}
    with pytest.raises(KeyError):
        fabric.load(path, state)
    state = {"model": model2, "step": 0, "missing": 1}
    fabric.load(path, state, strict=False)
    assert state["step"] == 2 and state["missing"] == 1

    raw = tmp_path / "raw.ckpt"
    fabric.save(raw, model.state_dict())
    _durable(fabric.strategy.checkpoint_io)
    model3 = torch.nn.Linear(6, 3)
    fabric.load_raw(raw, model3)
    _assert_same(_params(model), _params(model3), "load_raw")


@pytest.mark.parametrize("mode", MODES)
def test_directory_lists_only_final_names_while_saves_are_in_flight(tmp_path, mode, monkeypatch):
    """ModelCheckpoint(monitor=None, save_top_k=1, filename="model") keeps saving to one name: a listing of the
    directory at the next epoch's start is exactly ``["model.ckpt"]``. In async mode the listing is taken while the
    previous save is in flight -- all its data written, held before its commit -- and shows no temporary file."""
    held = None
    if mode in ASYNC_MODES:
        held = threading.Event()
        release = threading.Semaphore(0)
        real_finish = PlanWriter.finish

        def held_finish(*a, **kw):
            held.set()
            assert release.acquire(timeout=30)
            return real_finish(*a, **kw)

        monkeypatch.setattr(PlanWriter, "finish", held_finish)
    listings = []

    class ListDir(Model):
        def on_train_epoch_start(self):
            if self.current_epoch > 0:
                if held is not None:
                    assert held.wait(30)  # the previous epoch's save waits at its commit
                    held.clear()
                listings.append(_listing(tmp_path / "ck"))
                if held is not None:
                    release.release()

        def on_train_end(self):
            if held is not None:
                release.release()  # the last save

    mc = ModelCheckpoint(dirpath=tmp_path / "ck", monitor=None, save_top_k=1, filename="model")
    _trainer(tmp_path, mode, max_epochs=3, limit_train_batches=1, limit_val_batches=0, callbacks=[mc]).fit(ListDir())
    assert listings == [["model.ckpt"], ["model.ckpt"]]
    assert _listing(tmp_path / "ck") == ["model.ckpt"] and _tload(tmp_path / "ck" / "model.ckpt")["global_step"] == 3


# ------------------------------------------------------------------------------ weight averaging (item 8)


@pytest.mark.parametrize("mode", MODES)
def test_ema_weight_averaging_checkpoints_hold_at_save_values(request, tmp_path, mode, monkeypatch):
    """Item 8: with ``EMAWeightAveraging`` (which swaps the averaged weights in for validation and copies them
    into the model at the end through ``param.data``) every checkpoint holds exactly the state handed to the IO,
    and equals the stock run's."""
    from lightning.pytorch.callbacks import EMAWeightAveraging

    _slow_background(monkeypatch, mode)

    def run(root, m):
        model = Model(hidden=64)
        callbacks = [
            EMAWeightAveraging(decay=0.5),
            ModelCheckpoint(dirpath=root / "ck", save_top_k=-1, every_n_train_steps=1, filename="{step}"),
        ]
        trainer = _trainer(
            root, m, max_steps=6, val_check_interval=2, limit_val_batches=1, num_sanity_val_steps=0, callbacks=callbacks
        )
        trainer.fit(model)
        return model

    model, _, names = _compare_with_stock(run, request, tmp_path, mode)
    assert names == [f"step={s}.ckpt" for s in range(1, 7)]
    for name in names:
        ck = _tload(tmp_path / mode / "ck" / name)
        ref = model.saved[ck["global_step"]]
        assert set(ref) == {"state_dict", "optimizer_states", "current_model_state"}
        for k in ref:
            _assert_same(ref[k], ck[k], f"{name}:{k}")


# --------------------------------------------------------------------------- background errors (item 7)


def _fail_saves_after(monkeypatch, mode: str, n_ok: int) -> pl.Callback:
    """Every checkpoint write after the first ``n_ok`` raises ``OSError(EIO)`` (stock IO: in ``_atomic_save``).

    Returns a callback that, once a save that fails was submitted (ModelCheckpoint saves after every step, so
    after step ``n_ok + 1``), holds the next training batch until every save is over (``pending_saves`` is 0:
    the error is recorded): in async modes the failure then has certainly happened before the next call into the
    IO, however slowly the background writer runs on a loaded machine. (Waiting only once the failing write had
    started, or once it had failed, let a starved writer start after training ended: the error surfaced only at
    teardown.)"""
    calls = [0]

    def should_fail() -> bool:
        calls[0] += 1
        return calls[0] > n_ok

    class WaitForTheFailure(pl.Callback):
        def on_train_batch_start(self, trainer, *args) -> None:
            if trainer.global_step > n_ok:
                io, deadline = trainer.strategy.checkpoint_io, time.monotonic() + 60
                while getattr(io, "pending_saves", 0):
                    assert time.monotonic() < deadline, "the failing save never ended"
                    time.sleep(0.005)
                assert calls[0] > n_ok, "the injected write failure never ran"

    if mode == "stock":
        from lightning.fabric.plugins.io import torch_io

        real = torch_io._atomic_save

        def atomic_save(checkpoint, path):
            if should_fail():
                raise OSError(5, "injected write error", str(path))
            return real(checkpoint, path)

        monkeypatch.setattr(torch_io, "_atomic_save", atomic_save)
    else:
        real_finish = PlanWriter.finish

        def finish(*a, **kw):
            if should_fail():
                raise OSError(5, "injected write error")
            return real_finish(*a, **kw)

        monkeypatch.setattr(PlanWriter, "finish", finish)
    return WaitForTheFailure()


@pytest.mark.parametrize("mode", MODES)
def test_failed_save_surfaces_and_keeps_previous_checkpoint(tmp_path, mode, monkeypatch):
    """Item 7: a save that fails (synchronously, or in the background in async mode) makes ``fit`` raise -- at the
    next call into the IO or the optimizer step, never a hang -- and the earlier checkpoint stays intact."""
    wait_for_failure = _fail_saves_after(monkeypatch, mode, n_ok=1)
    model = Model()
    mc = ModelCheckpoint(dirpath=tmp_path / "ck", save_top_k=-1, every_n_train_steps=1, filename="{step}")
    trainer = _trainer(tmp_path, mode, max_steps=6, limit_val_batches=0, callbacks=[mc, wait_for_failure])
    with pytest.raises((OSError, AsyncCheckpointError)) as ei:
        _bounded(lambda: trainer.fit(model))
    err = ei.value
    if mode in ASYNC_MODES:
        assert isinstance(err, AsyncCheckpointError) and isinstance(err.__cause__, OSError)
    assert "injected write error" in str(err) + str(err.__cause__)
    assert trainer.global_step < 6  # training stopped at the error
    try:
        _durable(trainer.strategy.checkpoint_io)
    except AsyncCheckpointError:
        pass  # reported already, or the failure of a later save that was submitted before the error surfaced
    assert _listing(tmp_path / "ck") == ["step=1.ckpt"]  # no torn or empty file under a final name
    ck = _tload(tmp_path / "ck" / "step=1.ckpt")
    _assert_same(model.saved[1]["state_dict"], ck["state_dict"], "step=1")


@pytest.mark.parametrize("mode", MODES)
def test_failed_removal_surfaces_once_and_saving_goes_on(tmp_path, mode, monkeypatch):
    """Item 7: a failing ``remove_checkpoint`` raises at the call (synchronous IO) or at the next call (async,
    deferred behind a save in flight), exactly once; the saver is still alive and the file is kept."""
    _slow_background(monkeypatch, mode)
    io = make_io(mode)
    io.save_checkpoint({"k": 1}, tmp_path / "old.ckpt")
    _durable(io)

    def failing_rm(*a, **kw):
        raise PermissionError(13, "injected removal error")

    if mode == "stock":
        from fsspec.implementations.local import LocalFileSystem

        monkeypatch.setattr(LocalFileSystem, "rm", failing_rm)
    else:
        monkeypatch.setattr(async_io, "remove_path", failing_rm)
    io.save_checkpoint({"k": 2}, tmp_path / "new.ckpt")  # async: in flight, the removal is queued behind it
    errors = []
    for call in (
        lambda: io.remove_checkpoint(tmp_path / "old.ckpt"),
        lambda: io.save_checkpoint({"k": 3}, tmp_path / "newer.ckpt") or _durable(io),
        lambda: io.save_checkpoint({"k": 3}, tmp_path / "newer.ckpt"),
        lambda: _durable(io),
    ):
        try:
            _bounded(call)
        except (OSError, AsyncCheckpointError) as e:
            errors.append(e)
    assert len(errors) == 1, errors
    e = errors[0]  # async: AsyncCheckpointError from the deferred removal (the direct error if it was not deferred)
    assert isinstance(e.__cause__ if isinstance(e, AsyncCheckpointError) else e, PermissionError)
    assert _listing(tmp_path) == ["new.ckpt", "newer.ckpt", "old.ckpt"]
    assert [_tload(tmp_path / n)["k"] for n in ("old.ckpt", "new.ckpt", "newer.ckpt")] == [1, 2, 3]


# ------------------------------------------------------------------------- loads of in-flight saves (item 5)


@pytest.mark.parametrize("mode", MODES)
def test_load_through_another_instance_sees_the_save(tmp_path, mode, monkeypatch):
    """Item 5: a load of a path right after its save -- through another IO instance of the same kind, as
    Lightning's ``ckpt_path`` restore of a new Trainer does -- returns what was saved."""
    _slow_background(monkeypatch, mode, seconds=0.3)
    a, b = make_io(mode), make_io(mode)
    w = torch.nn.Parameter(torch.randn(64, 64))
    a.save_checkpoint({"w": w, "step": 7}, tmp_path / "x.ckpt")
    a.save_checkpoint({"other": 1}, tmp_path / "y.ckpt")
    got = _bounded(lambda: b.load_checkpoint(tmp_path / "x.ckpt"))
    assert got["step"] == 7 and torch.equal(got["w"], w.detach())
    _durable(a)
    assert _tload(tmp_path / "y.ckpt") == {"other": 1}


# ------------------------------------------------------------------------- allow-list, nested tensors (item 9)


class SafePoint:
    def __init__(self, x: int, y: int) -> None:
        self.x, self.y = x, y

    def __eq__(self, other) -> bool:
        return isinstance(other, SafePoint) and (self.x, self.y) == (other.x, other.y)


@pytest.mark.parametrize("mode", MODES)
def test_weights_only_allow_list_and_nested_tensors(tmp_path, mode):
    """Item 9: nested tensors save and load; ``weights_only`` loads reject a class that is not allow-listed and
    accept it under ``torch.serialization.safe_globals``, as ``torch.load`` does for the same file."""
    io = make_io(mode)
    nested = torch.nested.nested_tensor([torch.arange(2.0), torch.arange(3.0)])
    io.save_checkpoint({"nt": nested, "point": SafePoint(1, 2), "w": torch.ones(3)}, tmp_path / "a.ckpt")
    _durable(io)
    for load in (
        lambda **kw: io.load_checkpoint(tmp_path / "a.ckpt", **kw),
        lambda **kw: torch.load(tmp_path / "a.ckpt", **kw),
    ):
        with pytest.raises(pickle.UnpicklingError, match="SafePoint"):
            load(weights_only=True)
        with torch.serialization.safe_globals([SafePoint]):
            got = load(weights_only=True)
        assert got["point"] == SafePoint(1, 2) and torch.equal(got["w"], torch.ones(3))
        assert [t.tolist() for t in got["nt"].unbind()] == [[0.0, 1.0], [0.0, 1.0, 2.0]]
        assert load(weights_only=False)["point"] == SafePoint(1, 2)


# ------------------------------------------------------------------- storage_options, cross-device rename (issue 34)


@pytest.mark.parametrize("mode", MODES)
def test_storage_options_refused_with_lightnings_wording(tmp_path, mode):
    """Issue 34 item 3: ``Trainer.save_checkpoint(..., storage_options=...)`` with an IO that takes no storage options
    raises Lightning's own ``TypeError`` text (what Lightning's tests match), naming the IO's class."""
    trainer = _trainer(tmp_path, mode, max_steps=1, limit_val_batches=0, enable_checkpointing=False)
    trainer.fit(Model())
    name = type(trainer.strategy.checkpoint_io).__name__
    text = (
        "`Trainer.save_checkpoint(..., storage_options=...)` with `storage_options` arg"
        f" is not supported for `{name}`. Please implement your custom `CheckpointIO`"
        " to define how you'd like to use `storage_options`."
    )
    with pytest.raises(TypeError, match=re.escape(text)):
        trainer.save_checkpoint(tmp_path / "a.ckpt", storage_options={"x": 1})
    _durable(trainer.strategy.checkpoint_io)
    assert not (tmp_path / "a.ckpt").exists()


@pytest.mark.parametrize("mode", MODES)
def test_cross_device_rename_falls_back_to_a_copy(tmp_path, mode):
    """Issue 34 item 3: where ``os.rename`` fails with EXDEV (and ``os.chmod`` is not permitted), the save still
    lands under its final name with the saved values, as Lightning's ``_atomic_save`` (fsspec's move) does; no
    temporary is left behind."""
    model = Model()
    trainer = _trainer(tmp_path, mode, max_steps=2, limit_val_batches=0, enable_checkpointing=False)
    trainer.fit(model)
    path = tmp_path / "cross" / "hpc_ckpt.ckpt"
    with (
        mock.patch("os.rename", side_effect=OSError(errno.EXDEV, "Invalid cross-device link")),
        mock.patch("os.chmod", side_effect=PermissionError("Operation not permitted")),
    ):
        trainer.save_checkpoint(path)
        _durable(trainer.strategy.checkpoint_io)
    assert _listing(path.parent) == ["hpc_ckpt.ckpt"]
    ck = _tload(path)
    assert ck["global_step"] == 2
    _assert_same(_params(model), ck["state_dict"], "cross-device save")


# ----------------------------------------------- manual optimization: ModelCheckpoint's pre-step state (issue 34)


class PreStepStateModel(Model):
    """Lightning's documented recipe for ModelCheckpoint under manual optimization: ``training_step`` keeps the
    module's state before ``optimizer.step()`` in ``saved_models``; ModelCheckpoint loads it into ``layer`` for the
    save and loads the current state back right after (``load_state_dict``: an in-place copy into the parameters)."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.layer = self.net
        self.saved_models: dict = {}
        self.losses = [1.0, 1.0, 0.0, 1.0]

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("loss", self.losses[batch_idx], on_step=True, on_epoch=True)
        self.saved_models[batch_idx] = {k: v.detach().clone() for k, v in self.layer.state_dict().items()}
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()  # LightningOptimizer -> SGD.step
        return loss


@pytest.mark.parametrize("mode", MODES)
def test_manual_optimization_checkpoint_holds_the_pre_step_state(tmp_path, mode):
    """Issue 34 item 2 (Lightning's ``test_model_checkpoint_manual_opt``): the best checkpoint holds the state saved
    before ``optimizer.step()``. In lazy mode ModelCheckpoint's restoring ``load_state_dict`` runs right after the
    save, before the background copy: it must wait for the snapshot (it raced: ``SnapshotRaceError``)."""
    model = PreStepStateModel()
    mc = ModelCheckpoint(
        dirpath=tmp_path / "ck",
        monitor="loss",
        mode="min",
        save_top_k=1,
        every_n_train_steps=1,
        every_n_epochs=0,
        save_on_train_epoch_end=True,
        save_weights_only=True,
    )
    trainer = _trainer(tmp_path, mode, max_epochs=1, limit_val_batches=0, num_sanity_val_steps=0, callbacks=[mc])
    _bounded(lambda: trainer.fit(model, torch.utils.data.DataLoader(_data(), batch_size=4)))
    best = _tload(mc.best_model_path)["state_dict"]
    assert os.path.basename(mc.best_model_path) == "epoch=0-step=3.ckpt"
    for name, value in best.items():
        assert torch.equal(model.saved_models[2][name.removeprefix("layer.").removeprefix("net.")], value), name
