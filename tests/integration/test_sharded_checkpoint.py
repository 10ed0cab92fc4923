"""fabric.save / fabric.load with sharded replicas (replica_size=K>1): one DCP checkpoint directory.

Run 1: 3 replicas x 2 processes, 4 steps, ``fabric.save`` after step 2 (then trains on), and process 1
of replica 0 is SIGKILLed inside that save (fault phase ``save``: its part written, not yet reported,
while the other replicas write or wait for the reports). The survivors must not commit the round
that misses replica 0's part (replica 0, the lowest, was the one to commit): replica 1 removes the
round's temporary directory, the 2 survivors write the checkpoint again (each about half of the
items, 4 shard files) and train on, recomputing replica 0's microbatches at the next step. Run 2: a fresh 2 x 2 job that ``fabric.load``s that
checkpoint and trains steps 2..3. Both end equal to the unsharded single-process reference (float64,
relative difference <= 1e-9), the checkpoint verifies (CRC-32C of every shard), holds every key
and loads with stock ``dcp.load`` + ``FileSystemReader`` into one process without a process group
(4 shard files -> 1 process, full tensors equal to the parameters at step 2).
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from tests.compare import max_relative_difference
from tests.jobs import ROOT, run_job
from tests.scripts import sharded_train

SCRIPT = os.path.join(ROOT, "tests", "scripts", "sharded_train.py")
TOL = 1e-9
STEPS, SAVE_AT, M = 4, 2, 8


def _job(out: str, *extra: str, replicas: int = 2, inject: str | None = None):
    cmd = [sys.executable, SCRIPT, out, "--replicas", str(replicas), "--replica-size", "2", "--steps", str(STEPS)]
    env = {"LIGHTNING_RECOVER_INJECT": inject} if inject else None
    result = run_job([*cmd, "--microbatches", str(M), *extra], out, timeout=400, env=env)
    assert result.returncode == 0, result.output[-4000:]
    return result


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sharded_save_resume_and_stock_load(tmp_path, capsys):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from lightning_recover.checkpoint import verify_dcp_checkpoint
    from lightning_recover.checkpoint.dcp.sharded_state import checkpoint_keys

    ref_dir = str(tmp_path / "ref")  # sharded_train.py --reference, in this process (no interpreter start-up)
    sharded_train.reference(SimpleNamespace(out=ref_dir, steps=STEPS, microbatches=M, batch_size=4, dtype="float64"))
    reference = torch.load(os.path.join(ref_dir, "reference.pt"))["state"]

    ckpt = str(tmp_path / "ckpt")
    # the save runs after step index SAVE_AT - 1: the fault's step is the last step run
    inject = f"kill:replica=0:inner=1:step={SAVE_AT - 1}:phase=save"
    run1 = _job(str(tmp_path / "run1"), "--save-step", str(SAVE_AT), "--ckpt", ckpt, replicas=3, inject=inject)
    first = run1.states()
    assert sorted(first) == [1, 2], run1.output[-3000:]
    assert run1.output.count("injecting fault") == 1, run1.output[-3000:]
    assert "replica(s) [0] writing" in run1.output and "writing it again" in run1.output, run1.output[-3000:]
    for r, data in first.items():
        assert max_relative_difference(data["state"], reference) <= TOL, f"run 1 replica {r}"
        steps = {s["step"]: s for s in data["stats"]}
        assert [s["live_replicas"] for s in data["stats"]] == [3, 3, 2, 2]
        assert steps[SAVE_AT]["recoveries"] == 1, "the next step noticed the death and recomputed"
    assert sum(data["stats"][SAVE_AT]["recomputed"] for data in first.values()) > 0
    saved = first[1]["saved_state"]
    assert max_relative_difference(first[2]["saved_state"], saved) == 0.0

    # the survivors wrote about half of the items each (2 processes each): 4 shard files + sidecars;
    # nothing of the round that lost replica 0 (3 parts, files up to __5_0) is left
    names = sorted(os.listdir(ckpt))
    assert names == [".metadata"] + [f"__{i}_0.{ext}" for i in range(4) for ext in ("crc.json", "distcp")], names
    assert not [n for n in os.listdir(tmp_path) if ".dcp-tmp-" in n]
    info = verify_dcp_checkpoint(ckpt)
    assert info["verified"] and info["files"] == 4
    assert checkpoint_keys(ckpt) == {"model", "optimizer", "step"}
    # the items' bytes per file (file sizes would add up to 4 KiB of padding an item, which follows the tensors'
    # memory addresses: on this tiny model that alone moved the split across any fixed bound)
    from lightning_recover.checkpoint.dcp.reader import read_dcp_metadata

    sizes = [0] * 4
    for info in read_dcp_metadata(ckpt).storage_data.values():
        sizes[int(info.relative_path.split("_")[2])] += info.length
    assert min(sizes[0] + sizes[1], sizes[2] + sizes[3]) > 0.3 * sum(sizes), sizes

    # stock reader, one process, no process group: resharded 2 x 2 -> 1, full tensors
    assert not dist.is_initialized()
    full = {"model": {k: torch.empty_like(v) for k, v in reference.items()}}
    dcp.load(full, storage_reader=FileSystemReader(ckpt))
    assert max_relative_difference(full["model"], saved) == 0.0
    assert max_relative_difference(saved, reference) > 1e-3  # step 2 is not the end state

    # lightning-recover inspect / convert on the 2-shard directory
    from lightning_recover.cli import main

    code = main(["inspect", ckpt, "--json"])
    summary = json.loads(capsys.readouterr().out)
    assert code == 0 and summary["verified"] and [f["rank"] for f in summary["files"]] == [0, 1, 2, 3]
    items = {i["name"]: i for i in summary["items"]}
    chunks = items["model.2.weight"]["chunks"]  # (32, 32) split in rows over the replica's 2 processes
    assert items["model.2.weight"]["shape"] == [32, 32] and [c["shape"] for c in chunks] == [[16, 32], [16, 32]]
    assert sorted(c["file"] for c in chunks) in (["__0_0.distcp", "__1_0.distcp"], ["__2_0.distcp", "__3_0.distcp"])
    assert main(["convert", ckpt, str(tmp_path / "full.pt")]) == 0
    converted = torch.load(str(tmp_path / "full.pt"), weights_only=True)
    assert max_relative_difference(converted["model"], saved) == 0.0 and converted["step"] == SAVE_AT
    assert sorted(converted) == ["model", "optimizer", "step"] and converted["optimizer"]["state"]

    second = _job(str(tmp_path / "run2"), "--resume", ckpt).states()
    assert sorted(second) == [0, 1]
    for r, data in second.items():
        assert [s["step"] for s in data["stats"]] == list(range(SAVE_AT, STEPS))
        diff = max_relative_difference(data["state"], first[1]["state"])
        assert diff <= TOL, f"resumed replica {r} differs from the uninterrupted run by {diff}"
        assert max_relative_difference(data["state"], reference) <= TOL


# ---------------------------------------------------------------------------------- one process, fast


def _model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4, dtype=torch.float64)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_save_load_sharded_one_process(tmp_path):
    from lightning_recover.checkpoint.dcp.sharded_state import load_full, load_sharded, save_sharded

    model, optimizer = _model_and_optimizer(0)
    path = str(tmp_path / "ck")
    save_sharded(path, {"model": model, "optimizer": optimizer, "step": 7, "meta": {"name": "x", "ids": [1, 2]}})
    model2, optimizer2 = _model_and_optimizer(1)
    state = {"model": model2, "optimizer": optimizer2, "step": 0}
    rest = load_sharded(path, state)
    assert state["step"] == 7 and rest == {"meta": {"name": "x", "ids": [1, 2]}}
    assert max_relative_difference(model2.state_dict(), model.state_dict()) == 0.0
    for p, p2 in zip(model.parameters(), model2.parameters()):
        assert torch.equal(optimizer.state[p]["exp_avg_sq"], optimizer2.state[p2]["exp_avg_sq"])
    with pytest.raises(KeyError, match="HINT"):
        load_sharded(path, {"model": model2, "other": 1})
    full = load_full(path)
    assert sorted(full) == ["meta", "model", "optimizer", "step"]
    assert torch.equal(full["model"]["2.bias"], model[2].bias)


def test_damaged_shard_leaves_objects_untouched(tmp_path):
    from lightning_recover.checkpoint import CheckpointCorruptError
    from lightning_recover.checkpoint.dcp.sharded_state import load_sharded, save_sharded

    model, optimizer = _model_and_optimizer(0)
    path = str(tmp_path / "ck")
    save_sharded(path, {"model": model, "optimizer": optimizer})
    shard = os.path.join(path, "__0_0.distcp")
    data = bytearray(open(shard, "rb").read())
    data[-100] ^= 0xFF  # the last item (an optimizer tensor): earlier items load before it fails
    open(shard, "wb").write(bytes(data))
    model2, optimizer2 = _model_and_optimizer(1)
    before = {k: v.clone() for k, v in model2.state_dict().items()}
    with pytest.raises(CheckpointCorruptError, match="exp_avg_sq.*CRC-32C"):
        load_sharded(path, {"model": model2, "optimizer": optimizer2})
    assert max_relative_difference(model2.state_dict(), before) == 0.0


def test_metadata_with_foreign_globals_is_refused(tmp_path):
    import pickle

    from lightning_recover.checkpoint import UnsafeCheckpointError
    from lightning_recover.checkpoint.dcp.reader import read_dcp_metadata

    path = tmp_path / "ck"
    path.mkdir()

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    (path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(UnsafeCheckpointError, match="system"):
        read_dcp_metadata(path)


def test_parts_written_separately_merge_into_one_checkpoint(tmp_path, monkeypatch):
    """What two replicas do in fabric.save, in one process: each writes its part, one commits."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from lightning_recover.checkpoint import gc_pause, verify_dcp_checkpoint
    from lightning_recover.checkpoint.dcp.sharded_state import (
        assign_parts,
        commit_parts,
        load_sharded,
        part_count,
        save_part,
    )

    assert assign_parts({"a": 10, "b": 6, "c": 5, "d": 1}, 2) == [["a", "d"], ["b", "c"]]
    assert len(assign_parts({"a": 1}, 3)) == 1
    model, optimizer = _model_and_optimizer(0)
    state = {"model": model, "optimizer": optimizer, "step": 5}
    path = str(tmp_path / "ck")
    assert part_count(state, 2) == 2
    tails: list = []
    real_tail = gc_pause.GcPause.pause_tail
    monkeypatch.setattr(gc_pause.GcPause, "pause_tail", lambda self: tails.append(self) or real_tail(self))
    for q in range(2):
        save_part(path, state, "t0k3n", q, 2, base=q)
    # each part's writer hands the collector to the short tail, not the writer's 30 s bound
    assert len({id(t) for t in tails}) == 2
    assert not os.path.exists(path)  # nothing visible before the commit
    commit_parts(path, state, "t0k3n", 2)
    assert sorted(n for n in os.listdir(path) if n.endswith(".distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert verify_dcp_checkpoint(path)["files"] == 2 and os.listdir(tmp_path) == ["ck"]  # temp dir renamed
    model2, optimizer2 = _model_and_optimizer(1)
    restored = {"model": model2, "optimizer": optimizer2, "step": 0}
    assert load_sharded(path, restored) == {} and restored["step"] == 5
    assert max_relative_difference(model2.state_dict(), model.state_dict()) == 0.0
    full = {"model": {k: torch.empty_like(v) for k, v in model.state_dict().items()}}
    dcp.load(full, storage_reader=FileSystemReader(path))
    assert max_relative_difference(full["model"], model.state_dict()) == 0.0


def test_parts_saved_again_take_the_cached_protocol(tmp_path):
    """The next save of the same parts (training went on, same layout) skips DCP's exchange in each part
    (``DcpSaver.save_part``) and commits a checkpoint of the new values over the old one; another assignment of
    parts (a replica lost) is a full save again."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from lightning_recover.checkpoint import verify_dcp_checkpoint
    from lightning_recover.checkpoint.dcp.sharded_state import _PART_SAVERS, commit_parts, load_sharded, save_part
    from lightning_recover.checkpoint.dcp.writer import wait_for_removals

    _PART_SAVERS.clear()
    model, optimizer = _model_and_optimizer(0)
    state = {"model": model, "optimizer": optimizer, "step": 5}
    path = str(tmp_path / "ck")
    for round_, token in enumerate(("aa01", "aa02", "aa03")):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        state["step"] = 5 + round_
        for q in range(2):
            save_part(path, state, token, q, 2, base=q)
            assert _PART_SAVERS[(q, 2, q, 1)].last_protocol == ("dcp" if round_ == 0 else "cached")
        commit_parts(path, state, token, 2)
        assert wait_for_removals(timeout=60)  # the replaced checkpoint is removed on a thread
        assert verify_dcp_checkpoint(path)["files"] == 2 and os.listdir(tmp_path) == ["ck"]
        model2, optimizer2 = _model_and_optimizer(1)
        restored = {"model": model2, "optimizer": optimizer2, "step": 0}
        assert load_sharded(path, restored) == {} and restored["step"] == 5 + round_
        assert max_relative_difference(model2.state_dict(), model.state_dict()) == 0.0
        full = {"model": {k: torch.empty_like(v) for k, v in model.state_dict().items()}}
        dcp.load(full, storage_reader=FileSystemReader(path))  # the stock reader too
        assert max_relative_difference(full["model"], model.state_dict()) == 0.0

    save_part(path, state, "aa04", 0, 1, base=0)  # one replica left: one part, written by a new saver
    assert _PART_SAVERS[(0, 1, 0, 1)].last_protocol == "dcp"
    commit_parts(path, state, "aa04", 1)
    assert verify_dcp_checkpoint(path)["files"] == 1
