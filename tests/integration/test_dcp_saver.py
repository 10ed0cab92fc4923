"""DcpSaver: DCP checkpoints saved in a loop over a cached protocol (checkpoint/dcp/saver.py).

What it writes must be what ``dcp.save`` with ``UringStorageWriter`` writes, loadable by the stock reader,
whichever protocol a save took; a layout change must take the full one; a failure must leave the previous
checkpoint and nothing else.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import pickle
import subprocess
import textwrap
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from lightning_recover.checkpoint import UringStorageReader, UringStorageWriter, verify_dcp_checkpoint
from lightning_recover.checkpoint.dcp import saver as dcp_saver
from lightning_recover.checkpoint.dcp import writer as dcp_mod
from lightning_recover.checkpoint.dcp.metadata_template import MetadataTemplate
from lightning_recover.checkpoint.dcp.reader import read_dcp_metadata
from lightning_recover.checkpoint.dcp.saver import DcpSaver
from tests.compare import assert_same
from tests.jobs import gloo_ranks, two_rank_script, two_rank_tensors

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def make_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    state = {
        "w": torch.randn(256, 129, generator=g),
        "bf16": torch.randn(333, generator=g).to(torch.bfloat16),
        "view": torch.randn(50, generator=g)[7:31],
        "t": torch.randn(8, 6, generator=g).t(),
        "empty": torch.zeros(0, 5),
        "meta": {"step": 100 + seed, "name": f"run-{seed}"},  # bytes items
    }
    for k in range(200):
        state[f"small.{k}"] = torch.randn(k % 7 + 1, generator=g)
    return state


def blank(state: dict) -> dict:
    return {
        k: torch.full_like(v, 7) if isinstance(v, torch.Tensor) else {"step": 0, "name": ""} for k, v in state.items()
    }


def load_with(reader, state: dict) -> dict:
    out = blank(state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(out, storage_reader=reader)
    return out


def test_cached_saves_write_what_dcp_save_writes(tmp_path):
    """The first save is a full dcp.save, the next ones take the cached protocol; every checkpoint loads with the
    stock reader and ours, and its .metadata equals the one dcp.save with our writer writes for the same state."""
    state = make_state()
    saver = DcpSaver()
    protocols = []
    for i in range(3):
        with torch.no_grad():
            state["w"].add_(1.0)  # new values in the same memory: the layout is unchanged
        saver.save(state, tmp_path / f"ck{i}")
        protocols.append(saver.last_protocol)
        for reader in (FileSystemReader(tmp_path / f"ck{i}"), UringStorageReader(tmp_path / f"ck{i}")):
            assert_same(load_with(reader, state), state)
        assert verify_dcp_checkpoint(tmp_path / f"ck{i}")["files"] == 1
        # the cached protocol's .metadata (a rendered template) records the sidecars too (issue 34 item 4)
        assert dcp_mod.sidecars_recorded(read_dcp_metadata(tmp_path / f"ck{i}"))
    assert protocols == ["dcp", "cached", "cached"]
    dcp.save(state, storage_writer=UringStorageWriter(tmp_path / "by_dcp"))
    ours, theirs = read_dcp_metadata(tmp_path / "ck2"), read_dcp_metadata(tmp_path / "by_dcp")
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.planner_data == theirs.planner_data
    # where each item sits follows memory addresses (a view is copied afresh by every save): compare the rest
    assert {k: (v.relative_path, v.length) for k, v in ours.storage_data.items()} == {
        k: (v.relative_path, v.length) for k, v in theirs.storage_data.items()
    }
    assert str(ours.storage_meta.checkpoint_id) == str(tmp_path / "ck2")
    assert sorted(os.listdir(tmp_path / "ck2")) == sorted(os.listdir(tmp_path / "by_dcp"))
    assert not [n for n in os.listdir(tmp_path) if "dcp-tmp" in n]


def test_moved_items_update_the_metadata(tmp_path):
    """Items that land elsewhere in the file with the plan unchanged (a tensor reallocated, a bytes item that
    grew) take the cached protocol, and .metadata follows them."""
    state = make_state()
    saver = DcpSaver()
    saver.save(state, tmp_path / "a")
    state["w"] = state["w"].clone() + 1.0  # new memory: its offset follows the address modulo 4 KiB
    state["small.3"] = torch.randn(4)
    state["meta"] = {"step": 10**30, "name": "x" * 5000}  # the bytes item grows past its 4 KiB slot
    saver.save(state, tmp_path / "b")
    assert saver.last_protocol == "cached"
    for reader in (FileSystemReader(tmp_path / "b"), UringStorageReader(tmp_path / "b")):
        assert_same(load_with(reader, state), state)
    assert read_dcp_metadata(tmp_path / "b").storage_data != read_dcp_metadata(tmp_path / "a").storage_data
    first = make_state()  # the first checkpoint still holds the values of then
    assert_same(load_with(FileSystemReader(tmp_path / "a"), first), first)


def test_the_metadata_template_renders_any_ids(tmp_path):
    """A rendering unpickles to the metadata with the ids it was given: short and long (another length opcode),
    non-ASCII, and a metadata large enough to span many frames."""
    state = {f"t{i}": torch.ones(1) for i in range(3000)}
    dcp.save(state, storage_writer=UringStorageWriter(tmp_path / "ck"))
    md = read_dcp_metadata(tmp_path / "ck")
    template = MetadataTemplate(md)
    for cid, sid in [("/a", "x"), ("/" + "d" * 5000 + "/ck", "s" * 255), ("/päth/ck", ""), ("/x", "y" * 256)]:
        back = pickle.loads(template.render(cid, sid))
        assert back == dataclasses.replace(md, storage_meta=dcp_mod.sidecar_storage_meta(cid, sid))
    assert template.render("/a", "x") == pickle.dumps(
        dataclasses.replace(md, storage_meta=dcp_mod.sidecar_storage_meta("/a", "x")), protocol=4
    )


def test_a_changed_layout_takes_the_full_protocol(tmp_path):
    state = make_state()
    saver = DcpSaver()
    saver.save(state, tmp_path / "a")
    state["new"] = torch.arange(10)
    saver.save(state, tmp_path / "b")
    assert saver.last_protocol == "dcp"
    state["w"] = torch.randn(10, 10)  # another shape
    saver.save(state, tmp_path / "c")
    assert saver.last_protocol == "dcp"
    # each of what a tensor's item is made of: dtype, requires_grad, the key (same shape and count)
    for change in ("dtype", "requires_grad", "key"):
        if change == "dtype":
            state["w"] = state["w"].double()
        elif change == "requires_grad":
            state["w"] = state["w"].clone().requires_grad_(True)
        else:
            state["w2"] = state.pop("w")
        saver.save(state, tmp_path / f"c-{change}")
        assert saver.last_protocol == "dcp", change
        saver.save(state, tmp_path / f"c-{change}-again")
        assert saver.last_protocol == "cached", change
        assert_same(load_with(FileSystemReader(tmp_path / f"c-{change}-again"), state), state)
    saver.save(state, tmp_path / "d")
    assert saver.last_protocol == "cached"
    assert_same(load_with(FileSystemReader(tmp_path / "d"), state), state)


def test_a_failed_write_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    """The engine refuses the cached save's file (ENOSPC): CheckpointException, the previous checkpoint at the
    path is untouched and loadable, no temporary directory is left, and the next save is a full one."""
    state = make_state()
    saver = DcpSaver()
    path = tmp_path / "ck"
    saver.save(state, path)
    saver.save(state, path)
    assert saver.last_protocol == "cached"
    before = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
    with torch.no_grad():
        state["w"].add_(1.0)
    real_open = dcp_mod.open_writer

    def refuse(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    monkeypatch.setattr(dcp_mod, "open_writer", refuse)
    with pytest.raises(CheckpointException, match="previous one") as info:
        saver.save(state, path)
    assert "No space left" in str(info.value)
    assert not [n for n in os.listdir(tmp_path) if "dcp-tmp" in n]
    assert_same(load_with(FileSystemReader(path), state), before)
    monkeypatch.setattr(dcp_mod, "open_writer", real_open)
    saver.save(state, path)
    assert saver.last_protocol == "dcp"
    assert_same(load_with(UringStorageReader(path), state), state)


def test_a_failed_commit_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    state = make_state()
    saver = DcpSaver()
    path = tmp_path / "ck"
    saver.save(state, path)
    before = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
    with torch.no_grad():
        state["w"].add_(1.0)

    def fail(tmp, dst):
        raise OSError(errno.EIO, "rename failed (injected)")

    monkeypatch.setattr(dcp_saver, "commit_dir", fail)
    with pytest.raises(CheckpointException, match="rename failed"):
        saver.save(state, path)
    assert not [n for n in os.listdir(tmp_path) if "dcp-tmp" in n]
    assert_same(load_with(FileSystemReader(path), state), before)


def test_a_failed_plan_fails_the_save(tmp_path):
    """overwrite=False refuses an existing checkpoint while planning: nothing is written, the old one stays."""
    saver = DcpSaver(overwrite=False)
    saver.save({"a": torch.ones(3)}, tmp_path / "ck")
    saver.save({"a": torch.ones(3)}, tmp_path / "ck2")
    assert saver.last_protocol == "cached"
    with pytest.raises(CheckpointException, match="while planning") as info:
        saver.save({"a": torch.zeros(3)}, tmp_path / "ck")
    assert "overwrite=False" in str(info.value)
    assert not [n for n in os.listdir(tmp_path) if "dcp-tmp" in n]
    out = {"a": torch.zeros(3)}
    dcp.load(out, storage_reader=FileSystemReader(tmp_path / "ck"))
    assert torch.equal(out["a"], torch.ones(3))


# ------------------------------------------------------------------------------------- two processes

_TWO_RANKS = two_rank_script(
    """
    import errno
    from torch.distributed.checkpoint.api import CheckpointException
    from lightning_recover.checkpoint.dcp import writer as dcp_mod
    from lightning_recover.checkpoint.dcp.saver import DcpSaver
    root = arg
    state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
    state["shared"] = torch.arange(6.0)  # the same on both ranks: DCP's global plan writes it once
    state[f"rank{rank}_only"] = torch.full((5,), float(rank))
    state["step"] = 1
    saver = DcpSaver()
    seen = []

    def save(name):
        saver.save(state, os.path.join(root, name))
        seen.append(saver.last_protocol)

    save("s1")
    state["step"] = 2
    save("s2")
    # rank 1's private tensor reallocated and the step's pickle grown: the plan is unchanged, items move
    if rank == 1:
        state["rank1_only"] = state["rank1_only"].clone() * 3
    state["step"] = 10**40
    save("s3")
    # rank 0 alone changes its layout: every rank takes the full protocol
    if rank == 0:
        state["extra0"] = torch.ones(3)
    save("s4")
    save("s5")
    assert seen == ["dcp", "cached", "cached", "dcp", "cached"], seen
    # a DTensor's placements change its plan (its chunk): the full protocol, then cached again
    from torch.distributed.tensor import Replicate
    state["b"] = state["b"].redistribute(mesh, [Replicate()])
    save("s4b")
    save("s4c")
    assert seen[-2:] == ["dcp", "cached"], seen
    # rank 1's engine refuses its file: the save fails on both ranks, s5 is left as it was
    real_open = dcp_mod.open_writer
    if rank == 1:
        def refuse(*a, **k):
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        dcp_mod.open_writer = refuse
    with torch.no_grad():
        state["shared"].add_(100.0)
    try:
        save("s5")
        raise SystemExit("the failed save returned")
    except CheckpointException as exc:
        assert "[1]" in str(exc), str(exc)
    dcp_mod.open_writer = real_open
    with torch.no_grad():
        state["shared"].sub_(100.0)
    save("s6")
    assert seen[-1] == "dcp", seen
    """
)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_ranks_cached_saves_load_with_the_stock_reader(tmp_path):
    root = tmp_path / "cks"
    root.mkdir()
    with gloo_ranks(_TWO_RANKS, tmp_path, root) as procs:
        for pr in procs:
            assert pr.wait(timeout=200) == 0
    assert not [n for n in os.listdir(root) if "dcp-tmp" in n]
    full = two_rank_tensors()

    def load(name: str, step: int, extra: bool) -> None:
        out = {"w": torch.zeros(64, 33), "b": torch.zeros(10, dtype=torch.bfloat16), "shared": torch.zeros(6)}
        out |= {"rank0_only": torch.zeros(5), "rank1_only": torch.zeros(5), "step": 0}
        if extra:
            out["extra0"] = torch.zeros(3)
        for reader in (FileSystemReader(root / name), UringStorageReader(root / name)):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.load(out, storage_reader=reader)
            assert torch.equal(out["w"], full["w"]) and torch.equal(out["b"], full["b"]), name
            assert torch.equal(out["shared"], torch.arange(6.0)) and out["step"] == step, name
            assert torch.equal(out["rank0_only"], torch.zeros(5)), name
            assert torch.equal(out["rank1_only"], torch.full((5,), 1.0 if name in ("s1", "s2") else 3.0)), name
            if extra:
                assert torch.equal(out["extra0"], torch.ones(3))
        assert verify_dcp_checkpoint(root / name)["files"] == 2

    load("s1", 1, False)
    load("s2", 2, False)
    load("s3", 10**40, False)
    load("s4c", 10**40, True)
    load("s5", 10**40, True)
    load("s6", 10**40, True)


_SPREAD_PARTS = two_rank_script(
    """
    import errno
    from lightning_recover.checkpoint.dcp import sharded_state as dcp_state, writer as dcp_mod
    from lightning_recover.checkpoint.dcp.saver import DcpSaveError
    root = arg
    state = {"model": {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}}
    state["shared"], state["step"] = torch.arange(6.0), 1
    seen = []

    def spread(name, token):
        # both parts written by this group, as two replicas of it would (files __0_, __1_ and __2_, __3_)
        for q in range(2):
            dcp_state.save_part(os.path.join(root, name), state, token, q, 2, base=2 * q)
            seen.append(dcp_state._PART_SAVERS[(q, 2, 2 * q, 2)].last_protocol)
        dist.barrier()
        if rank == 0:
            dcp_state.commit_parts(os.path.join(root, name), state, token, 2)
        dist.barrier()

    spread("ck1", "t1")
    state["step"] = 2
    with torch.no_grad():
        state["model"]["w"].add_(1.0)
    spread("ck2", "t2")
    state["shared"] = state["shared"].clone() * 2  # reallocated: its extent moves, the plan stays
    state["step"] = 10**40
    spread("ck3", "t3")
    assert seen == ["dcp", "dcp", "cached", "cached", "cached", "cached"], seen
    # rank 1's engine refuses its file in part 1: that part fails on both ranks, its shared directory is left
    # for the spread save's committer to abandon
    real_open = dcp_mod.open_writer
    dcp_state.save_part(os.path.join(root, "ck4"), state, "t4", 0, 2, base=0)
    if rank == 1:
        def refuse(*a, **k):
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        dcp_mod.open_writer = refuse
    try:
        dcp_state.save_part(os.path.join(root, "ck4"), state, "t4", 1, 2, base=2)
        raise SystemExit("the failed part returned")
    except DcpSaveError as exc:
        assert "[1]" in str(exc), str(exc)
    dcp_mod.open_writer = real_open
    dist.barrier()
    tmp = dcp_mod.temp_dir_for(os.path.join(root, "ck4"), "t4")
    assert os.path.isdir(tmp) and "__0_0.distcp" in os.listdir(tmp), os.listdir(root)
    dist.barrier()  # both ranks have looked before rank 0 abandons it
    if rank == 0:
        dcp_state.abandon_parts(os.path.join(root, "ck4"), "t4")
    dist.barrier()
    seen.clear()
    spread("ck5", "t5")
    assert seen == ["cached", "dcp"], seen  # the failed part's saver starts over
    """
)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_ranks_spread_parts_take_the_cached_protocol(tmp_path):
    """``dcp_state.save_part`` (the spread save of sharded replicas) over a group of two gloo ranks: the first save of
    each part is a full ``dcp.save``, the next ones the cached protocol; a moved item, a failed part (the shared
    directory left for the committer to abandon) and the part that failed starting over. Every committed
    checkpoint loads with both readers."""
    root = tmp_path / "cks"
    root.mkdir()
    with gloo_ranks(_SPREAD_PARTS, tmp_path, root) as procs:
        for pr in procs:
            assert pr.wait(timeout=200) == 0
    assert sorted(os.listdir(root)) == ["ck1", "ck2", "ck3", "ck5"]
    full = two_rank_tensors()
    rounds = (("ck1", 1, 0, 1), ("ck2", 2, 1, 1), ("ck3", 10**40, 1, 2), ("ck5", 10**40, 1, 2))
    for name, step, w_plus, shared_times in rounds:
        for reader in (FileSystemReader(root / name), UringStorageReader(root / name)):
            out = {"model": {"w": torch.zeros(64, 33), "b": torch.zeros(10, dtype=torch.bfloat16)}}
            out |= {"shared": torch.zeros(6), "step": 0}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.load(out, storage_reader=reader)
            assert torch.equal(out["model"]["w"], full["w"] + w_plus), name
            assert torch.equal(out["model"]["b"], full["b"]), name
            assert torch.equal(out["shared"], torch.arange(6.0) * shared_times) and out["step"] == step, name
        assert verify_dcp_checkpoint(root / name)["files"] == 4
        assert dcp_mod.sidecars_recorded(read_dcp_metadata(root / name)), name  # the merged .metadata too


_DEAD_PEER = textwrap.dedent(
    """
    import os, sys, time, warnings
    from datetime import timedelta
    warnings.simplefilter("ignore")
    import torch, torch.distributed as dist
    from lightning_recover.checkpoint.dcp import writer as dcp_mod
    from lightning_recover.checkpoint.dcp.saver import DcpSaver
    rank, root, store = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group(
        "gloo", init_method="file://" + store, rank=rank, world_size=2, timeout=timedelta(seconds=30)
    )
    state = {f"t{rank}": torch.full((1000,), float(rank)), "step": 1}
    saver = DcpSaver()
    saver.save(state, os.path.join(root, "ck"))
    saver.save(state, os.path.join(root, "ck"))
    assert saver.last_protocol == "cached"
    if rank == 1:
        def die(*a, **k):
            os._exit(17)  # the process dies while it writes its file
        dcp_mod.open_writer = die
    state["step"] = 2
    t0 = time.monotonic()
    try:
        saver.save(state, os.path.join(root, "ck"))
    except BaseException as exc:
        print("RAISED", type(exc).__name__, round(time.monotonic() - t0, 1), flush=True)
        os._exit(0)
    os._exit(3)
    """
)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_dead_peer_ends_the_save_with_an_error(tmp_path):
    """A rank that dies in the middle of a cached save: the survivor's collective fails (gloo sees the peer's
    connection close) and it raises well inside the group's 30 s timeout; nothing is committed."""
    root = tmp_path / "cks"
    root.mkdir()
    with gloo_ranks(_DEAD_PEER, tmp_path, root, stdout=subprocess.PIPE, text=True) as procs:
        out0, _ = procs[0].communicate(timeout=90)
        assert procs[1].wait(timeout=30) == 17
    assert procs[0].returncode == 0, out0
    raised = [line.split() for line in out0.splitlines() if line.startswith("RAISED")]
    assert raised and float(raised[0][2]) < 30, out0
    out = {"t0": torch.zeros(1000), "t1": torch.zeros(1000), "step": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(out, storage_reader=FileSystemReader(root / "ck"))
    assert out["step"] == 1 and torch.equal(out["t1"], torch.ones(1000))
