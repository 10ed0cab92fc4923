"""Recycled checkpoint files: a removed or replaced checkpoint's file is written over by the next save in its
directory (``checkpoint/file/spare_files.py``), never where anybody else could see the change."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch

from lightning_recover.checkpoint.file.single_file import save
from lightning_recover.checkpoint.file.spare_files import IN_PLACE_FILESYSTEMS, SpareFiles, filesystem_type
from lightning_recover.lightning.checkpoint_io import AsyncUringCheckpointIO, UringCheckpointIO


@pytest.fixture
def recycle_on(monkeypatch):
    """Recycling on whatever filesystem ``tmp_path`` is (``on`` recycles on ext4 and XFS only)."""
    monkeypatch.setenv("LIGHTNING_RECOVER_RECYCLE", "any")


def _state(k: int, n: int) -> dict:
    g = torch.Generator().manual_seed(k)
    return {"step": k, "state_dict": {"w": torch.randn(n, generator=g), "b": torch.arange(k + 3)}}


def _hidden(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith("."))


MARK = 0xA5  # the removed checkpoint's bytes: a run of them in the new file would be a stale leftover


def _longest_mark_run(path) -> int:
    return max((len(run) for run in re.findall(rb"\xa5+", open(path, "rb").read())), default=0)


def test_a_removed_checkpoint_is_written_over_in_place_and_no_byte_of_it_survives(tmp_path, recycle_on):
    io = UringCheckpointIO()
    # the kept file is the larger, all MARK bytes: the save must overwrite every byte it keeps and cut the rest
    old, new = {"filler": torch.full((4_000_000,), MARK, dtype=torch.uint8)}, _state(2, 250_000)
    io.save_checkpoint(old, tmp_path / "a.ckpt")
    inode = os.stat(tmp_path / "a.ckpt").st_ino
    io.remove_checkpoint(tmp_path / "a.ckpt")
    assert not (tmp_path / "a.ckpt").exists() and len(_hidden(tmp_path)) == 1 and io.spares.kept == 1

    io.save_checkpoint(new, tmp_path / "b.ckpt")
    assert io.spares.taken == 1 and os.stat(tmp_path / "b.ckpt").st_ino == inode  # the same blocks, overwritten
    assert sorted(os.listdir(tmp_path)) == ["b.ckpt"]
    fresh = tmp_path / "fresh" / "b.ckpt"
    save(new, fresh)
    assert _longest_mark_run(tmp_path / "b.ckpt") == _longest_mark_run(fresh) < 8
    loaded = io.load_checkpoint(tmp_path / "b.ckpt")
    assert torch.equal(loaded["state_dict"]["w"], new["state_dict"]["w"]) and loaded["step"] == 2
    torch.load(tmp_path / "b.ckpt", weights_only=True, mmap=True)  # still a torch.save archive


def test_a_replaced_file_is_kept_for_the_save_after_next_and_teardown_removes_what_is_kept(tmp_path, recycle_on):
    io = UringCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint(_state(1, 100_000), path)
    first = os.stat(path).st_ino
    io.save_checkpoint(_state(2, 100_000), path)  # replaces the first: its file is kept under a temporary name
    assert io.spares.kept == 1 and len(_hidden(tmp_path)) == 1
    assert io.load_checkpoint(path)["step"] == 2
    io.save_checkpoint(_state(3, 100_000), path)  # writes over the first file, keeps the second
    assert os.stat(path).st_ino == first and io.spares.taken == 1 and io.load_checkpoint(path)["step"] == 3
    io.teardown()
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]


def test_a_file_open_elsewhere_or_linked_elsewhere_is_never_written_over(tmp_path, recycle_on):
    io = UringCheckpointIO()
    io.save_checkpoint(_state(1, 100_000), tmp_path / "a.ckpt")
    before = open(tmp_path / "a.ckpt", "rb").read()
    with open(tmp_path / "a.ckpt", "rb") as reader:  # a reader (an eval job, say) still holds it
        io.remove_checkpoint(tmp_path / "a.ckpt")
        io.save_checkpoint(_state(2, 100_000), tmp_path / "b.ckpt")
        assert io.spares.taken == 0  # refused at the take: the save wrote a new file
        assert reader.read() == before
    assert sorted(os.listdir(tmp_path)) == ["b.ckpt"]  # the refused file was removed

    io.save_checkpoint(_state(3, 100_000), tmp_path / "c.ckpt")
    os.link(tmp_path / "c.ckpt", tmp_path / "best.ckpt")  # another name for the same file
    kept = io.spares.kept
    io.remove_checkpoint(tmp_path / "c.ckpt")
    assert io.spares.kept == kept and not (tmp_path / "c.ckpt").exists()  # removed, not kept
    io.save_checkpoint(_state(4, 100_000), tmp_path / "d.ckpt")
    assert io.load_checkpoint(tmp_path / "best.ckpt")["step"] == 3


def test_on_recycles_on_ext4_and_xfs_only_and_off_the_default_or_a_bad_value_never(tmp_path, monkeypatch):
    def kept_after_remove(directory) -> bool:
        spares = SpareFiles()
        save(_state(1, 1000), os.path.join(directory, "x.ckpt"))
        kept = spares.keep_removed(os.path.join(directory, "x.ckpt"))
        spares.discard()
        if not kept:
            os.unlink(os.path.join(directory, "x.ckpt"))
        return kept

    monkeypatch.delenv("LIGHTNING_RECOVER_RECYCLE", raising=False)
    assert not kept_after_remove(tmp_path)  # off by default
    monkeypatch.setenv("LIGHTNING_RECOVER_RECYCLE", "on")
    fd = os.open(tmp_path, os.O_RDONLY)
    in_place = filesystem_type(fd) in IN_PLACE_FILESYSTEMS
    os.close(fd)
    assert kept_after_remove(tmp_path) == in_place
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:  # tmpfs: nothing to gain
        assert not kept_after_remove(shm)
        monkeypatch.setenv("LIGHTNING_RECOVER_RECYCLE", "any")
        assert kept_after_remove(shm)
    monkeypatch.setenv("LIGHTNING_RECOVER_RECYCLE", "maybe")
    with pytest.raises(ValueError, match="LIGHTNING_RECOVER_RECYCLE must be off, on or any"):
        UringCheckpointIO().remove_checkpoint(tmp_path / "nothing.ckpt")


def test_a_failed_save_over_a_kept_file_leaves_the_checkpoints_as_they_were(tmp_path, recycle_on):
    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle (injected)")

    io = UringCheckpointIO()
    io.save_checkpoint(_state(1, 100_000), tmp_path / "a.ckpt")
    io.save_checkpoint(_state(2, 100_000), tmp_path / "b.ckpt")
    io.remove_checkpoint(tmp_path / "a.ckpt")
    with pytest.raises(RuntimeError, match="injected"):
        io.save_checkpoint({"state": _state(3, 100_000), "bad": Unpicklable()}, tmp_path / "c.ckpt")
    assert io.spares.taken == 1 and sorted(os.listdir(tmp_path)) == ["b.ckpt"]  # the kept file went with it
    assert io.load_checkpoint(tmp_path / "b.ckpt")["step"] == 2


@pytest.mark.slow  # a child interpreter (imports torch)
def test_a_process_that_exits_without_teardown_removes_what_it_kept_and_a_forked_child_does_not(tmp_path):
    # Fabric has no teardown: fabric.save over one name twice keeps the first file until the process exits
    script = textwrap.dedent(
        f"""
        import os, torch
        os.environ["LIGHTNING_RECOVER_RECYCLE"] = "any"
        from lightning_recover.lightning.checkpoint_io import UringCheckpointIO
        io = UringCheckpointIO()
        path = {str(tmp_path / "model.ckpt")!r}
        io.save_checkpoint({{"w": torch.ones(1000)}}, path)
        io.save_checkpoint({{"w": torch.zeros(1000)}}, path)
        assert io.spares.kept == 1 and len(os.listdir(os.path.dirname(path))) == 2
        pid = os.fork()
        if pid == 0:
            raise SystemExit(0)  # a child's exit (atexit runs) leaves the parent's kept file alone
        os.waitpid(pid, 0)
        assert len(os.listdir(os.path.dirname(path))) == 2
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    assert sorted(os.listdir(tmp_path)) == ["model.ckpt"]
    assert torch.equal(torch.load(tmp_path / "model.ckpt", weights_only=True)["w"], torch.zeros(1000))


@pytest.mark.slow  # a child interpreter (imports torch)
def test_a_kept_file_of_a_process_that_died_is_removed_by_the_next_save_in_its_directory(tmp_path):
    script = textwrap.dedent(
        f"""
        import os, torch
        os.environ["LIGHTNING_RECOVER_RECYCLE"] = "any"
        from lightning_recover.lightning.checkpoint_io import UringCheckpointIO
        io = UringCheckpointIO()
        io.save_checkpoint({{"w": torch.ones(1000)}}, {str(tmp_path / "a.ckpt")!r})
        io.remove_checkpoint({str(tmp_path / "a.ckpt")!r})
        assert io.spares.kept == 1
        os._exit(0)  # no teardown: the kept file stays behind
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    assert len(_hidden(tmp_path)) == 1
    save({"w": torch.zeros(10)}, tmp_path / "b.ckpt")
    assert sorted(os.listdir(tmp_path)) == ["b.ckpt"]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_top1_rotation_in_a_trainer_writes_over_the_removed_file_and_saves_what_the_stock_io_saves(
    tmp_path, recycle_on, mode
):
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(64, 64)

        def training_step(self, batch, _):
            return self.layer(batch).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.01)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.randn(6, 64, generator=torch.Generator().manual_seed(0)))

    def fit(root, plugins):
        torch.manual_seed(0)
        mc = ModelCheckpoint(dirpath=root, save_top_k=1, monitor="step", mode="max", every_n_train_steps=1)
        trainer = pl.Trainer(
            default_root_dir=root, max_epochs=1, callbacks=[mc], plugins=plugins, logger=False,
            enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
        )  # fmt: skip
        trainer.fit(Model())
        return mc.best_model_path

    sync_io = UringCheckpointIO()
    ours = fit(tmp_path / "ours", [sync_io if mode == "sync" else AsyncUringCheckpointIO(sync_io)])
    stock = fit(tmp_path / "stock", [])
    assert sync_io.spares.taken == 4  # six steps: the first save and the one after it find nothing kept
    assert sorted(os.listdir(tmp_path / "ours")) == sorted(os.listdir(tmp_path / "stock"))  # teardown: none kept
    a, b = torch.load(ours, weights_only=False), torch.load(stock, weights_only=False)
    assert a["global_step"] == b["global_step"] == 6
    for k, v in b["state_dict"].items():
        assert torch.equal(a["state_dict"][k], v), k
