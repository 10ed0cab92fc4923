"""DCP storage backend: round trips both ways with stock DCP, corruption, torn saves, async, resharding."""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import time
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from lightning_recover.checkpoint import (
    CheckpointCorruptError,
    UringStorageReader,
    UringStorageWriter,
    cleanup_dcp_temps,
    verify_dcp_checkpoint,
)
from lightning_recover.checkpoint.dcp import reader as dcp_reader
from lightning_recover.checkpoint.dcp import snapshot as dcp_snapshot
from lightning_recover.checkpoint.dcp import writer as dcp_mod
from tests.compare import assert_same
from tests.jobs import gloo_ranks, two_rank_script, two_rank_tensors

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def make_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    state = {
        "w": torch.randn(256, 129, generator=g),
        "bf16": torch.randn(333, generator=g).to(torch.bfloat16),
        "half": torch.randn(17, 3, generator=g).half(),
        "i64": torch.randint(0, 1 << 40, (99,), generator=g),
        "u8": torch.randint(0, 255, (4097,), generator=g, dtype=torch.uint8),
        "flag": torch.tensor([True, False, True]),
        "scalar": torch.tensor(float(seed) + 0.25),
        "empty": torch.zeros(0, 5),
        "view": torch.randn(50, generator=g)[7:31],  # a view: only its bytes are saved
        "t": torch.randn(8, 6, generator=g).t(),  # non-contiguous, full storage
        "meta": {"step": 100 + seed, "name": f"run-{seed}", "lr": [0.1, 0.01]},  # bytes items
    }
    for k in range(300):  # many small tensors: the case coalescing exists for
        state[f"small.{k}"] = torch.randn(k % 7 + 1, generator=g)
    return state


def blank(state: dict) -> dict:
    out = {}
    for k, v in state.items():
        out[k] = torch.full_like(v, 7) if isinstance(v, torch.Tensor) else {"step": 0, "name": "", "lr": [0.0, 0.0]}
    return out


def load_with(reader, like: dict) -> dict:
    out = blank(like)
    dcp.load(out, storage_reader=reader)
    return out


@contextlib.contextmanager
def corrupt(match: str, typed: bool = True):
    """DCP wraps a rank's error in CheckpointException (a BaseException): find ours inside and match it.

    DCP turns a failed metadata read into an AssertionError carrying our message: ``typed=False``.
    """
    with pytest.raises(BaseException) as info:
        yield
    exc = info.value
    errors = [e for e, _ in exc.failures.values()] if isinstance(exc, CheckpointException) else [exc]
    assert any((isinstance(e, CheckpointCorruptError) or not typed) and re.search(match, str(e)) for e in errors), str(
        exc
    )


def largest_item(path: str):
    with open(os.path.join(path, ".metadata"), "rb") as f:
        md = pickle.load(f)  # test-only: reading our own freshly written metadata, as DCP does
    return max(md.storage_data.items(), key=lambda kv: kv[1].length)


def flip_bit_in_largest_item(path: str):
    """Flip one bit inside the tensor data of the checkpoint's largest item; returns that item's index."""
    index, sinfo = largest_item(path)
    with open(os.path.join(path, sinfo.relative_path), "r+b") as f:
        f.seek(sinfo.offset + sinfo.length - 4096)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    return index


def test_round_trip_ours(tmp_path):
    state = make_state()
    p = str(tmp_path / "ck")
    dcp.save(state, storage_writer=UringStorageWriter(p))
    assert sorted(os.listdir(p)) == [".metadata", "__0_0.crc.json", "__0_0.distcp"]
    assert os.listdir(tmp_path) == ["ck"]  # no temporary left behind
    assert_same(load_with(UringStorageReader(p), state), state)
    info = verify_dcp_checkpoint(p)
    assert info["verified"] and info["items"] == len(state) - 1 + 3  # the meta dict flattens into 3 bytes items


def test_preallocated_save_round_trips_and_detects_damage(tmp_path, monkeypatch):
    """LIGHTNING_RECOVER_PREALLOCATE=on: each rank's file is reserved from the plan's estimate, size included,
    before the first write (reservation.py); the checkpoint is the same (ours and the stock reader load it, a
    flipped byte is caught)."""
    from lightning_recover.checkpoint import engine

    reserved: list = []
    real = engine.reserve_size

    def spy(path, nbytes):
        err = real(path, nbytes)
        reserved.append((os.path.basename(path), nbytes, err, os.path.getsize(path)))
        return err

    monkeypatch.setattr(engine, "reserve_size", spy)
    monkeypatch.setenv("LIGHTNING_RECOVER_PREALLOCATE", "on")
    state = make_state(5)
    p = str(tmp_path / "ck")
    dcp.save(state, storage_writer=UringStorageWriter(p))
    ((name, nbytes, err, size_at_open),) = reserved
    shard = os.path.join(p, name)
    assert err is None and size_at_open == nbytes >= os.path.getsize(shard)  # the estimate bounds the file
    assert_same(load_with(UringStorageReader(p), state), state)
    assert_same(load_with(FileSystemReader(p), state), state)
    index = flip_bit_in_largest_item(p)
    with corrupt(rf"__0_0\.distcp: item {index.fqn} .*CRC-32C"):
        load_with(UringStorageReader(p), state)


def test_tensor_data_placed_congruent_to_its_memory(tmp_path):
    """Storage bytes sit at a file offset equal to the tensor's address modulo 4 KiB, so a large tensor's
    aligned body goes to the disk from its own memory; the stock reader and ours still load it."""
    big = torch.randn(3 << 20, generator=torch.Generator().manual_seed(5))  # 12 MiB: above unstaged_min
    state = {**make_state(), "big": big}
    p = str(tmp_path / "ck")
    dcp.save(state, storage_writer=UringStorageWriter(p))
    with open(os.path.join(p, ".metadata"), "rb") as f:
        md = pickle.load(f)  # test-only: reading our own freshly written metadata, as DCP does
    for index, sinfo in md.storage_data.items():
        if index.fqn not in ("big", "w"):
            continue
        with open(os.path.join(p, sinfo.relative_path), "rb") as f:
            f.seek(sinfo.offset)
            archive = f.read(sinfo.length)
        reader = torch._C.PyTorchFileReader(__import__("io").BytesIO(archive))
        data_at = sinfo.offset + reader.get_record_offset("data/0")
        assert data_at % 4096 == state[index.fqn].untyped_storage().data_ptr() % 4096, index.fqn
    assert_same(load_with(FileSystemReader(p), state), state)
    assert_same(load_with(UringStorageReader(p), state), state)


def test_whole_tensors_load_straight_into_their_targets_and_are_still_verified(tmp_path, monkeypatch):
    big = torch.randn(3 << 20, generator=torch.Generator().manual_seed(6))  # 12 MiB
    state = {**make_state(), "big": big, "big_bf16": big[: 1 << 20].to(torch.bfloat16)}
    p = str(tmp_path / "ck")
    dcp.save(state, storage_writer=UringStorageWriter(p))
    read_into = []
    real = dcp_reader._whole_target

    def spy(rec, reqs, planner):
        got = real(rec, reqs, planner)
        if got is not None:
            read_into.append(rec["fqn"])
        return got

    monkeypatch.setattr(dcp_reader, "_whole_target", spy)
    assert_same(load_with(UringStorageReader(p), state), state)
    assert {"big", "big_bf16", "w"} <= set(read_into)  # whole contiguous tensors; not the view or transposed
    assert "t" not in read_into
    index, sinfo = largest_item(p)  # "big": a flipped bit in its bytes is caught after landing in the target
    with open(os.path.join(p, sinfo.relative_path), "r+b") as f:
        f.seek(sinfo.offset + sinfo.length // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    with corrupt("item big "):
        load_with(UringStorageReader(p), state)


def test_stock_reader_loads_ours(tmp_path):
    state = make_state(1)
    p = str(tmp_path / "ck")
    dcp.save(state, storage_writer=UringStorageWriter(p))
    assert_same(load_with(FileSystemReader(p), state), state)


def test_stock_checkpoint_records_no_sidecars_and_loads_unverified(tmp_path):
    """Issue 34 item 4: a ``FileSystemWriter`` checkpoint records no sidecars: ours loads it (unverified, as the
    stock reader does) and ``verify_dcp_checkpoint`` says it is not verified."""
    state = make_state(4)
    p = str(tmp_path / "stock")
    dcp.save(state, storage_writer=FileSystemWriter(p))
    assert not dcp_mod.sidecars_recorded(dcp_reader.read_dcp_metadata(p))
    assert_same(load_with(UringStorageReader(p), state), state)
    assert verify_dcp_checkpoint(p)["verified"] is False


def test_ours_loads_stock(tmp_path):
    state = make_state(2)
    p = str(tmp_path / "stock")
    dcp.save(state, storage_writer=FileSystemWriter(p))
    assert_same(load_with(UringStorageReader(p), state), state)
    assert verify_dcp_checkpoint(p)["verified"] is False


def test_flipped_byte_detected_by_ours_silent_in_stock(tmp_path):
    state = make_state(3)
    p = str(tmp_path / "ck")
    dcp.save(state, storage_writer=UringStorageWriter(p))
    index = flip_bit_in_largest_item(p)
    with corrupt(rf"__0_0\.distcp: item {index.fqn} .*CRC-32C"):
        load_with(UringStorageReader(p), state)
    with corrupt(index.fqn):
        verify_dcp_checkpoint(p)
    # the stock reader loads the damaged tensor without a word: the gain this backend brings
    silent = load_with(FileSystemReader(p), state)
    assert not torch.equal(silent[index.fqn], state[index.fqn])


def test_truncated_shard_detected(tmp_path):
    state = make_state(4)
    p = str(tmp_path / "ck")
    dcp.save(state, storage_writer=UringStorageWriter(p))
    shard = os.path.join(p, "__0_0.distcp")
    os.truncate(shard, os.path.getsize(shard) - 100)
    with corrupt(r"__0_0\.distcp: .*truncated"):
        load_with(UringStorageReader(p), state)


def test_missing_shard_and_sidecar_detected(tmp_path):
    """Issue 34 item 4: ``.metadata`` records that sidecars were written, so a checkpoint of ours whose sidecars are
    all gone is refused (named error with a HINT), by the reader and by ``verify_dcp_checkpoint``, instead of
    loading unverified as if it were a stock one; ``verify=False`` is the explicit way to load it anyway."""
    state = make_state(5)
    p = str(tmp_path / "ck")
    dcp.save(state, storage_writer=UringStorageWriter(p))
    assert dcp_mod.sidecars_recorded(dcp_reader.read_dcp_metadata(p))
    os.unlink(os.path.join(p, "__0_0.crc.json"))
    with corrupt(r"__0_0\.crc\.json.*were written with this checkpoint.*HINT: .*verify=False"):
        load_with(UringStorageReader(p), state)
    with pytest.raises(dcp_reader.SidecarsMissingError, match=r"__0_0\.crc\.json"):
        verify_dcp_checkpoint(p)
    assert_same(load_with(UringStorageReader(p, verify=False), state), state)
    os.unlink(os.path.join(p, "__0_0.distcp"))
    with corrupt(r"__0_0\.distcp: shard file missing"):  # also unverified: a missing shard is an error
        load_with(UringStorageReader(p, verify=False), state)


def test_torn_save_keeps_previous_and_is_refused(tmp_path, monkeypatch):
    old, new = make_state(6), make_state(7)
    p = str(tmp_path / "ck")
    dcp.save(old, storage_writer=UringStorageWriter(p))

    # crash after every shard and .metadata are durable, just before the directory is renamed
    def crash(tmp, path):
        raise KeyboardInterrupt("simulated crash at commit")

    monkeypatch.setattr(dcp_mod, "commit_dir", crash)
    with pytest.raises(BaseException, match="simulated crash"):
        dcp.save(new, storage_writer=UringStorageWriter(p))
    monkeypatch.undo()
    assert_same(load_with(UringStorageReader(p), old), old)  # the previous checkpoint is untouched
    temps = [n for n in os.listdir(tmp_path) if n != "ck"]
    assert len(temps) == 1 and temps[0].startswith(".ck.dcp-tmp-")

    # crash in the middle of writing the shard (the planner hands over an item, then the process dies)
    calls = {"n": 0}
    real = UringStorageWriter._write_file

    def dying_write(self, tmp, file_name, plan, planner):
        orig = planner.resolve_data

        def resolve(item):
            calls["n"] += 1
            if calls["n"] == 50:
                raise KeyboardInterrupt("simulated crash while writing")
            return orig(item)

        planner.resolve_data = resolve
        return real(self, tmp, file_name, plan, planner)

    monkeypatch.setattr(UringStorageWriter, "_write_file", dying_write)
    with pytest.raises(BaseException, match="simulated crash"):
        dcp.save(new, storage_writer=UringStorageWriter(str(tmp_path / "ck2")))
    monkeypatch.undo()
    assert not os.path.exists(tmp_path / "ck2")
    with corrupt("not a complete DCP checkpoint.*does not exist", typed=False):
        load_with(UringStorageReader(str(tmp_path / "ck2")), new)
    # a directory without .metadata (e.g. a copied torn temp) is refused too
    torn = [n for n in os.listdir(tmp_path) if n.startswith(".ck2.dcp-tmp-")][0]
    with corrupt("no .metadata", typed=False):
        load_with(UringStorageReader(str(tmp_path / torn)), new)
    assert len(cleanup_dcp_temps(str(tmp_path))) == 2
    assert os.listdir(tmp_path) == ["ck"]


def test_overwrite_replaces_atomically(tmp_path):
    """The previous checkpoint is swapped out in one step and removed in the background under a name of its own;
    one that a process left behind (it ended first) goes with the next commit in the directory, or with
    cleanup_dcp_temps."""
    p = str(tmp_path / "ck")
    dcp.save(make_state(8), storage_writer=UringStorageWriter(p))
    new = make_state(9)
    left = tmp_path / ".other.dcp-old-0123456789ab"
    (left / "sub").mkdir(parents=True)
    dcp.save(new, storage_writer=UringStorageWriter(p))
    assert [n for n in os.listdir(tmp_path) if "dcp-tmp" in n] == []
    assert dcp_mod.wait_for_removals(timeout=60)
    assert os.listdir(tmp_path) == ["ck"]
    left.mkdir()
    assert cleanup_dcp_temps(str(tmp_path)) == [str(left)]
    assert_same(load_with(UringStorageReader(p), new), new)
    with pytest.raises(BaseException, match="overwrite=False"):
        dcp.save(new, storage_writer=UringStorageWriter(p, overwrite=False))


def test_async_save(tmp_path):
    state = make_state(10)
    p = str(tmp_path / "ck")
    fut = dcp.async_save(state, storage_writer=UringStorageWriter(p))
    fut.result(timeout=120)
    assert_same(load_with(UringStorageReader(p), state), state)


def _big_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"big": torch.randn(1 << 19, generator=g), "small": torch.randn(8, generator=g), "step": seed}


def _delay_copies(monkeypatch, seconds: float) -> None:
    """Make the background copy start late, so that the training thread runs during the snapshot."""
    copy = dcp_snapshot.LazySnapshot._copy

    def slow(self, *args):
        time.sleep(seconds)
        copy(self, *args)

    monkeypatch.setattr(dcp_snapshot.LazySnapshot, "_copy", slow)


def test_lazy_async_save_round_trip_reuses_its_staging_buffers(tmp_path):
    writer = UringStorageWriter(str(tmp_path / "a"), lazy_snapshot=True)
    for i, name in enumerate(("a", "b")):
        state = _big_state(i)
        resp = dcp.async_save(state, storage_writer=writer, checkpoint_id=str(tmp_path / name))
        resp.upload_completion.result(timeout=120)
        back = {"big": torch.zeros(1 << 19), "small": torch.zeros(8), "step": -1}
        dcp.load(back, storage_reader=UringStorageReader(str(tmp_path / name)))
        assert (
            torch.equal(back["big"], state["big"]) and torch.equal(back["small"], state["small"]) and back["step"] == i
        )
    assert writer.staging_allocations == 1, "the second save of the same layout reuses the staging buffers"
    assert writer.snapshot_blocked_s < 5
    writer.close()


def test_lazy_snapshot_optimizer_step_waits_for_the_copy(tmp_path, monkeypatch):
    """optimizer.step() right after async_save: the checkpoint holds the parameters before the step."""
    _delay_copies(monkeypatch, 0.3)
    p = torch.nn.Parameter(torch.randn(1 << 19))
    opt = torch.optim.SGD([p], lr=1.0)
    before = p.detach().clone()
    writer = UringStorageWriter(str(tmp_path / "ck"), lazy_snapshot=True)
    resp = dcp.async_save({"p": p}, storage_writer=writer)
    p.grad = torch.ones_like(p)
    opt.step()  # the snapshot guard holds it until the copy is done
    resp.upload_completion.result(timeout=120)
    back = {"p": torch.zeros(1 << 19)}
    dcp.load(back, storage_reader=UringStorageReader(str(tmp_path / "ck")))
    assert torch.equal(back["p"], before) and not torch.equal(p.detach(), before)
    writer.close()


def test_lazy_snapshot_raced_by_an_in_place_change_fails_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = str(tmp_path / "ck")
    old = _big_state(0)
    dcp.save(old, storage_writer=UringStorageWriter(path))
    _delay_copies(monkeypatch, 0.3)
    state = _big_state(1)
    resp = dcp.async_save(state, storage_writer=UringStorageWriter(path, lazy_snapshot=True))
    with torch.no_grad():
        state["big"].mul_(2.0)  # outside optimizer.step, e.g. an EMA callback
    with pytest.raises(BaseException, match="changed in place"):
        resp.upload_completion.result(timeout=120)
    back = {"big": torch.zeros(1 << 19), "small": torch.zeros(8), "step": -1}
    dcp.load(back, storage_reader=UringStorageReader(path))
    assert torch.equal(back["big"], old["big"]) and back["step"] == 0, "the previous checkpoint is untouched"


_TWO_RANKS = two_rank_script(
    """
    import torch.distributed.checkpoint as dcp
    from lightning_recover.checkpoint import UringStorageWriter, UringStorageReader
    path = arg
    state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
    state[f"rank{rank}_only"] = torch.full((5,), float(rank))
    state["step"] = 42
    dcp.save(state, storage_writer=UringStorageWriter(path))
    # the collector: back on every rank within the tail bound after its last hook (DCP's exchanges end first)
    import gc, time
    from lightning_recover.checkpoint.gc_pause import TAIL_S
    t0 = time.monotonic()
    while not gc.isenabled() and time.monotonic() - t0 < TAIL_S + 10:
        time.sleep(0.05)
    assert gc.isenabled() and time.monotonic() - t0 < TAIL_S + 3.0
    # and back into the same 2-rank layout with our reader
    back = {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)]) for k, v in full.items()}
    back[f"rank{rank}_only"] = torch.zeros(5)
    back["step"] = 0
    dcp.load(back, storage_reader=UringStorageReader(path))
    for k, v in full.items():
        assert torch.equal(back[k].full_tensor(), v), k
    assert back["step"] == 42 and torch.equal(back[f"rank{rank}_only"], torch.full((5,), float(rank)))
    # resharding the other way: a checkpoint written by ONE process (the test, before this job) is
    # loaded by two ranks, each reading only its Shard(0) rows
    one = {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)]) for k, v in full.items()}
    dcp.load(one, storage_reader=UringStorageReader(path + "-one"))
    for k, v in full.items():
        assert torch.equal(one[k].to_local(), v.chunk(2)[rank]), k
    # lazy async save of DTensors: rank 1 changes w in place while its snapshot is still being copied:
    # the save fails on BOTH ranks (no rank left in a collective), nothing is committed at path + "-lazy"
    from lightning_recover.checkpoint.dcp import snapshot as dcp_snapshot
    copy = dcp_snapshot.LazySnapshot._copy
    def slow_copy(self, *a):
        import time; time.sleep(0.5 if rank == 1 else 0.0); copy(self, *a)
    dcp_snapshot.LazySnapshot._copy = slow_copy
    writer = UringStorageWriter(path + "-lazy", lazy_snapshot=True, eager_bytes=0)
    resp = dcp.async_save(state, storage_writer=writer)
    if rank == 1:
        with torch.no_grad():
            state["w"].add_(1.0)
    try:
        resp.upload_completion.result(timeout=120)
        raise SystemExit("the raced save was committed")
    except BaseException as exc:
        assert "changed in place" in str(exc), str(exc)
    assert not os.path.exists(path + "-lazy")
    dcp_snapshot.LazySnapshot._copy = copy
    writer.wait_for_snapshot()
    resp = dcp.async_save(state, storage_writer=writer)  # the same writer: staging buffers reused
    resp.upload_completion.result(timeout=120)
    assert writer.staging_allocations == 1
    writer.close()
    """
)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_ranks_save_reshard_to_one(tmp_path):
    p = str(tmp_path / "ck")
    written_by_one = two_rank_tensors()
    dcp.save(written_by_one, storage_writer=UringStorageWriter(p + "-one"))  # one process, no process group
    with gloo_ranks(_TWO_RANKS, tmp_path, p) as procs:
        for pr in procs:
            assert pr.wait(timeout=200) == 0
    names = sorted(os.listdir(p))
    assert names == [".metadata", "__0_0.crc.json", "__0_0.distcp", "__1_0.crc.json", "__1_0.distcp"]
    # the raced lazy save left only its (never committed) temporary directory, which cleanup removes
    assert [n for n in os.listdir(tmp_path) if "dcp-tmp" in n] == [n for n in os.listdir(tmp_path) if ".ck-lazy." in n]
    assert len(cleanup_dcp_temps(str(tmp_path))) == 1
    # one process, no process group, plain tensors: DCP's planner reassembles the shards
    full = two_rank_tensors()
    for reader in (UringStorageReader(p), FileSystemReader(p)):
        out = {"w": torch.zeros(64, 33), "b": torch.zeros(10, dtype=torch.bfloat16), "rank1_only": torch.zeros(5)}
        out["step"] = 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(out, storage_reader=reader)
        assert torch.equal(out["w"], full["w"]) and torch.equal(out["b"], full["b"])
        assert torch.equal(out["rank1_only"], torch.ones(5)) and out["step"] == 42
    assert verify_dcp_checkpoint(p)["files"] == 2
    lazy = {"w": torch.zeros(64, 33), "b": torch.zeros(10, dtype=torch.bfloat16)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(lazy, storage_reader=UringStorageReader(p + "-lazy"))
    changed = full["w"].clone()
    changed[32:] += 1.0  # rank 1's shard, changed in place before the second (successful) lazy save
    assert torch.equal(lazy["w"], changed) and torch.equal(lazy["b"], full["b"])


# ------------------------------------------------------------------- plan caching (dcp_plan_cache.py)


def _fresh_plan_caches(monkeypatch) -> None:
    """torch keeps its plan caches on the SavePlanner class: give this test empty ones of its own."""
    from torch.distributed.checkpoint.planner import SavePlanner

    for cache in (
        "_cached_save_plan",
        "_cached_final_save_plan",
        "_cached_all_plans",
        "_cached_global_plan",
        "_cached_metadata",
    ):
        monkeypatch.setattr(SavePlanner, cache, {})


def test_caching_planner_reuses_the_plan_with_each_saves_own_directory(tmp_path, monkeypatch):
    """Saves of an unchanged layout reuse the plan (no usable local plan is sent), yet each writes its own
    temporary directory: to two paths, then over the first."""
    from lightning_recover.checkpoint import CachingSavePlanner

    _fresh_plan_caches(monkeypatch)
    usable: list = []
    real = CachingSavePlanner.create_local_plan
    monkeypatch.setattr(
        CachingSavePlanner, "create_local_plan", lambda self: usable.append(real(self).usable) or self.plan
    )
    tokens: list = []
    real_tmp = dcp_mod.temp_dir_for
    monkeypatch.setattr(dcp_mod, "temp_dir_for", lambda path, token: tokens.append(token) or real_tmp(path, token))
    for i, name in enumerate(("a", "b", "a")):
        state = make_state(i)
        dcp.save(state, storage_writer=UringStorageWriter(str(tmp_path / name)), planner=CachingSavePlanner())
        assert_same(load_with(UringStorageReader(str(tmp_path / name)), state), state)
        assert_same(load_with(FileSystemReader(str(tmp_path / name)), state), state)
    assert usable == [True, False, False]  # the second and third saves sent no plan
    assert len(set(tokens)) == 3  # but each had its own temporary directory
    assert sorted(os.listdir(tmp_path)) == ["a", "b"]


def test_cached_metadata_keeps_its_storage_data_while_it_is_unchanged(tmp_path, monkeypatch):
    """Through a cached plan, a save whose items land where the last save's did (the same tensors, whose memory
    addresses place their bytes) keeps the storage-data dict the cached metadata holds: the fresh results die
    with the save instead of growing the collector's oldest generation. A bytes item that grew moves the items
    after it: the dict is replaced, and both readers load the new checkpoint right."""
    from torch.distributed.checkpoint.planner import SavePlanner

    from lightning_recover.checkpoint import CachingSavePlanner

    _fresh_plan_caches(monkeypatch)

    def save(name: str, state: dict) -> dict:
        dcp.save(state, storage_writer=UringStorageWriter(str(tmp_path / name)), planner=CachingSavePlanner())
        (metadata,) = SavePlanner._cached_metadata.values()
        return metadata.storage_data

    state = make_state(0)
    del state["view"]  # saved as a fresh clone each time, whose new address moves its bytes
    first = save("a", state)
    state["w"].add_(1.0)  # new values in the same tensors, as a training loop saves its parameters again
    assert save("b", state) is first
    state["meta"]["name"] = "a name long enough to move every item after it " * 20
    moved = save("c", state)
    assert moved is not first and moved != first
    assert_same(load_with(UringStorageReader(str(tmp_path / "c")), state), state)
    back = blank(state)
    dcp.load(back, storage_reader=FileSystemReader(str(tmp_path / "c")))
    assert_same(back, state)
    with open(tmp_path / "c" / ".metadata", "rb") as f:
        assert str(pickle.load(f).storage_meta.checkpoint_id) == str(tmp_path / "c")  # test-only: our own metadata


def test_caching_planner_resolves_every_item_as_torchs_planner_does():
    """``CachingSavePlanner.lookup_object`` short-cuts plain tensors; every item resolves to what
    ``DefaultSavePlanner`` gives (the same tensor object, the same bytes), and a missing key is torch's error."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from lightning_recover.checkpoint import CachingSavePlanner

    state = make_state(0)
    state["param"] = torch.nn.Parameter(torch.ones(3))  # a subclass: torch's own lookup
    ours, stock = CachingSavePlanner(), DefaultSavePlanner()
    for planner in (ours, stock):
        planner.set_up_planner(state, None, True)
    items = stock.create_local_plan().items
    assert len(items) > 300
    for item in items:
        a, b = ours.resolve_data(item), stock.resolve_data(item)
        if isinstance(b, torch.Tensor):
            assert a is b, item.index.fqn
        else:
            assert a.getvalue() == b.getvalue(), item.index.fqn
    with pytest.raises(ValueError, match="Could not find FQN"):
        ours.lookup_object(MetadataIndex("no.such.key"))
    with pytest.raises(ValueError, match="can't find by offset"):
        ours.lookup_object(MetadataIndex("w", torch.Size([1, 0])))  # a plain tensor holds no other chunk


def test_stock_caching_planner_works_too(tmp_path, monkeypatch):
    """torch's own caching planner hands the writer the last save's storage data (the same temporary directory
    name); saves one after another still commit and load."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    _fresh_plan_caches(monkeypatch)
    for i, name in enumerate(("a", "a", "b")):
        state = make_state(i)
        dcp.save(
            state,
            storage_writer=UringStorageWriter(str(tmp_path / name)),
            planner=DefaultSavePlanner(enable_plan_caching=True),
        )
        assert_same(load_with(UringStorageReader(str(tmp_path / name)), state), state)
    assert sorted(os.listdir(tmp_path)) == ["a", "b"]
