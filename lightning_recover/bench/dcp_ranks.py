"""Sharded DCP checkpoints by N processes: UringStorageWriter/Reader vs DCP's stock FileSystem ones vs fio.

    lightning-recover bench checkpoint --ranks 1,2,4 [--size-gb 1] [--repeat 3] [--small 2048] [--json OUT]

For each N, N processes (gloo, one host) hold the same GPT-like training state (parameters + AdamW
moments, fp32, ``gpt_state.config_for_size``) sharded N ways (``Shard(0)`` DTensors over a 1-D CPU
mesh, as FSDP2 holds them). Each round runs every contender once, in this order, and the medians
over the rounds are reported (ratios are taken within a round first, then their median):

* **save**, durable: ``dcp.save`` with ``UringStorageWriter`` (ours), ``DcpSaver.save`` (ours, the same
  writer without DCP's per-item exchange once the layout is cached: ``checkpoint/dcp/saver.py``; its first
  save, the full one, is untimed, and its checkpoint is loaded and checked once per state),
  ``FileSystemWriter(thread_count=1)`` (DCP's default) and ``thread_count=4``; then fio writes the same
  bytes (``--numjobs=N --bs=16M --direct=1 --ioengine=io_uring --end_fsync=1``, one file per job).
  GB/s = state bytes / wall time of the save on rank 0 from a barrier to the barrier after it (planning,
  writing, fsync, commit); fio = bytes / (wall time of the fio process less the wall time of a 1 MiB-per-job
  fio run: its start-up).
  With N=1 and torchsnapshot installed, ``Snapshot.take`` of the same tensors as plain tensors
  (it fails on DTensors and never fsyncs: its figure is not durable).
* **load**, cold (every file dropped from the page cache with ``POSIX_FADV_DONTNEED`` first) into a
  preallocated sharded state: ``UringStorageReader`` on our checkpoint (CRC-32C of every extent
  verified) and the stock ``FileSystemReader`` on the stock writer's checkpoint; fio reads its files
  (``--rw=read``, same options, start-up subtracted).
* **async** (GPT state): seconds ``dcp.async_save`` blocks the caller, per GB, and seconds until the
  checkpoint is durable: stock (``FileSystemWriter``, DCP's blocking staging), ours with DCP's
  staging reused (``cache_staged_state_dict=True``) and ours lazy (``lazy_snapshot=True``).

* **spread save** (GPT state): what ``fabric.save`` does with sharded replicas, as one replica of N processes runs
  it (one part): ``dcp_state.save_part`` over the N ranks (a ``DcpSaver`` part: cached after its first, untimed
  save), then ``dcp_state.commit_parts`` on rank 0 (reads the part's metadata back, merges, commits), timed like
  the saves above. Its first checkpoint is loaded and checked once.

The second state (``--small`` tensors per rank under ``"model"``, rank-private keys, not sharded) holds the
same bytes per rank as the GPT state's shard, split into that many tensors: the per-item costs.

The third (``floor``) has as many one-element tensors per rank: a save of it writes almost nothing, so its
seconds are what DCP's per-item protocol costs (planning, the plan and result exchanges, the metadata, the
broadcast, the fsyncs and the commit) before and after any bytes move. With the data written at fio's speed
and nothing of that overlapped, ours/fio for the small state can be at most fio_s / (fio_s + floor_s).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

from lightning_recover.bench.checkpoint import make_cold
from lightning_recover.bench.fio import huge_iomem as fio_huge_iomem

WRITERS = ("uring", "saver", "fsw_t1", "fsw_t4")  # saver: DcpSaver, the others through dcp.save
READERS = {"uring": "uring", "fsr": "fsw_t4"}  # reader -> the writer whose checkpoint it loads
ASYNC = ("stock", "uring_cached", "uring_lazy")


def _writer(name: str, path: str) -> Any:
    from torch.distributed.checkpoint import FileSystemWriter

    from lightning_recover.checkpoint import UringStorageWriter

    if name == "uring":
        return UringStorageWriter(path)
    return FileSystemWriter(path, thread_count=int(name.split("_t")[1]))


def _timed_save(name: str, state: dict, path: str, args: argparse.Namespace, saver: Any) -> float:
    """Seconds of one save by the contender ``name`` (``saver``: the state's own ``DcpSaver``)."""
    import torch.distributed.checkpoint as dcp

    if name == "saver":
        return _timed(saver.save, state, path)
    return _timed(dcp.save, state, storage_writer=_writer(name, path), planner=_planner(name, args))


_spread_saves = itertools.count()


def _spread_save(state: dict, path: str) -> None:
    """The spread save of one replica (Q = 1): its part over this group, then the merge and commit on rank 0. The
    token is the same on every rank (each rank counts its saves)."""
    import torch.distributed as dist

    from lightning_recover.checkpoint.dcp.sharded_state import commit_parts, save_part

    token = f"bench{next(_spread_saves):011x}"
    save_part(path, state, token, 0, 1, base=0)
    if dist.get_rank() == 0:
        commit_parts(path, state, token, 1)


def _reader(name: str, path: str) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    from lightning_recover.checkpoint import UringStorageReader

    return UringStorageReader(path) if name == "uring" else FileSystemReader(path)


def _async_writer(name: str, path: str) -> Any:
    from torch.distributed.checkpoint import FileSystemWriter

    from lightning_recover.checkpoint import UringStorageWriter

    if name == "stock":
        return FileSystemWriter(path)
    return UringStorageWriter(path, cache_staged_state_dict=True, lazy_snapshot=name == "uring_lazy")


def _sharded_state(size_gb: float, mesh: Any, seed: int) -> tuple[dict, int, int]:
    """(state, full bytes, tensors) of the GPT-like state, each tensor Shard(0) over ``mesh``."""
    import torch
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from lightning_recover.bench.gpt_state import config_for_size

    cfg = config_for_size(size_gb * 1e9)
    gen = torch.Generator().manual_seed(seed + mesh.get_local_rank())
    model: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    nbytes = ntensors = 0

    def shard(shape: tuple[int, ...]) -> Any:
        local_shape, _ = compute_local_shape_and_global_offset(shape, mesh, [Shard(0)])
        local = torch.empty(local_shape).uniform_(-1.0, 1.0, generator=gen)
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride)

    for name, shape in cfg.param_shapes().items():
        model[name] = shard(shape)
        optim[name] = {"exp_avg": shard(shape), "exp_avg_sq": shard(shape), "step": torch.tensor(1000.0)}
        nbytes += 3 * math.prod(shape) * 4 + 4
        ntensors += 4
    return {"model": model, "optim": {"state": optim}, "step": 1000}, nbytes, ntensors


def _small_state(count: int, per_rank_bytes: int, rank: int, world: int) -> tuple[dict, int, int]:
    import torch

    gen = torch.Generator().manual_seed(rank)
    numel = max(1, per_rank_bytes // count // 4)
    # under one key, as callers pass a model's state ({"model": ...}): dcp.save wraps each top-level value in a
    # logging call of its own, ~30 us a key for every writer alike, which a flat dict would add per tensor
    state = {"model": {f"r{rank}.t{i}": torch.rand(numel, generator=gen) for i in range(count)}}
    return state, count * numel * 4 * world, count * world


def _blank_like(state: Any) -> Any:
    """A preallocated load target with ``state``'s structure (DTensors stay DTensors)."""
    import torch

    if isinstance(state, dict):
        return {k: _blank_like(v) for k, v in state.items()}
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    return state


def _plain(state: Any, prefix: str = "") -> dict:
    """Flat ``{"a/b": tensor}`` of local tensors (torchsnapshot's baseline runs on plain tensors only)."""
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        return {k: v for key, val in state.items() for k, v in _plain(val, f"{prefix}{key}/").items()}
    if isinstance(state, DTensor):
        return {prefix.rstrip("/"): state.to_local()}
    if isinstance(state, torch.Tensor):
        return {prefix.rstrip("/"): state}
    return {}


def _check_loaded(loaded: dict, saved: dict, reader: str) -> None:
    """Untimed: every loaded tensor equals the saved one (a benchmark of a wrong load measures nothing)."""
    import torch

    got, want = _plain(loaded), _plain(saved)
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    if bad:
        raise RuntimeError(f"{reader} loaded different values for {len(bad)} tensors, e.g. {bad[0]}")


def _fio_wall(directory: str, rw: str, per_job: int, jobs: int, bs: str = "16M") -> tuple[float, int]:
    cmd = ["fio", "--name=w", f"--directory={directory}", f"--rw={rw}", f"--bs={bs}", "--direct=1"]
    cmd += ["--ioengine=io_uring", f"--numjobs={jobs}", f"--size={per_job}", "--group_reporting"]
    iomem = fio_huge_iomem(jobs * (16 << 20))  # huge-page buffers where reserved (fio.huge_iomem)
    cmd += [f"--iomem={iomem}"] if iomem else []
    cmd += ["--output-format=json", *(["--end_fsync=1"] if rw == "write" else [])]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"fio failed: {proc.stderr.strip() or proc.stdout.strip()}")
    doc = json.loads(proc.stdout[proc.stdout.index("{") :])
    return wall, int(doc["jobs"][0]["read" if rw == "read" else "write"]["io_bytes"])


def _fio(directory: str, nbytes: int, jobs: int) -> dict:
    """fio write then cold read of ``nbytes`` in ``jobs`` files: GB/s by wall time less fio's start-up."""
    per_job = -(-nbytes // jobs // (16 << 20)) * (16 << 20)
    out = {}
    for rw in ("write", "read"):
        tiny = os.path.join(directory, "tiny")
        os.makedirs(tiny, exist_ok=True)
        startup, _ = _fio_wall(tiny, "write", 1 << 20, jobs, bs="1M")  # 1 MiB per job: start-up
        if rw == "read":
            make_cold(directory, "fadvise")
        wall, moved = _fio_wall(directory, rw, per_job, jobs)
        out[rw] = moved / max(wall - startup, 1e-6) / 1e9
        shutil.rmtree(tiny, ignore_errors=True)
    return out


def _timed(fn: Any, *args: Any, **kwargs: Any) -> float:
    import torch.distributed as dist

    dist.barrier()
    t = time.perf_counter()
    fn(*args, **kwargs)
    dist.barrier()
    return time.perf_counter() - t


def _torchsnapshot_save(state: dict, path: str) -> float:
    import torchsnapshot

    app_state = {"state": torchsnapshot.StateDict(**_plain(state))}
    t = time.perf_counter()
    torchsnapshot.Snapshot.take(path, app_state=app_state)
    return time.perf_counter() - t


def _planner(name: str, args: argparse.Namespace) -> Any:
    """With ``--plan-cache``: a planner that reuses the last save's plan while the layout is unchanged, as a
    training loop's saves would (ours: ``CachingSavePlanner``; stock: torch's ``enable_plan_caching``)."""
    if not args.plan_cache:
        return None
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from lightning_recover.checkpoint import CachingSavePlanner

    return CachingSavePlanner() if name == "uring" else DefaultSavePlanner(enable_plan_caching=True)


def _one_round(
    state: dict, nbytes: int, work: str, args: argparse.Namespace, rank: int, saver: Any, spread: bool = False
) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    world = dist.get_world_size()
    out: dict[str, float] = {}
    dirs = {name: os.path.join(work, f"ck_{name}") for name in (*WRITERS, "spread")}
    if rank == 0:
        for d in dirs.values():
            shutil.rmtree(d, ignore_errors=True)
        os.sync()
    for name in WRITERS:
        out[f"save/{name}"] = nbytes / _timed_save(name, state, dirs[name], args, saver) / 1e9
    if spread:
        out["save/spread"] = nbytes / _timed(_spread_save, state, dirs["spread"]) / 1e9
    if world == 1 and args.torchsnapshot:
        snap = os.path.join(work, "snap")
        shutil.rmtree(snap, ignore_errors=True)
        out["save/torchsnapshot"] = nbytes / _torchsnapshot_save(state, snap) / 1e9
        shutil.rmtree(snap, ignore_errors=True)
    target = _blank_like(state)
    for reader, written_by in READERS.items():
        if rank == 0:
            make_cold(dirs[written_by], "fadvise")
        secs = _timed(dcp.load, target, storage_reader=_reader(reader, dirs[written_by]))
        out[f"load/{reader}"] = nbytes / secs / 1e9
        _check_loaded(target, state, reader)
    if args.fio:
        fio_dir = os.path.join(work, "fio")
        if rank == 0:
            shutil.rmtree(fio_dir, ignore_errors=True)
            os.makedirs(fio_dir)
            fio = _fio(fio_dir, nbytes, world)
            out["save/fio"], out["load/fio"] = fio["write"], fio["read"]
            shutil.rmtree(fio_dir, ignore_errors=True)
        dist.barrier()
    return out


def _floor_round(state: dict, work: str, args: argparse.Namespace, saver: Any) -> dict:
    """Seconds of a save of the floor state (one-element tensors) with every writer (each over its last one)."""
    return {f"floor_s/{n}": _timed_save(n, state, os.path.join(work, f"floor_{n}"), args, saver) for n in WRITERS}


def _check_written(state: dict, work: str, rank: int, save: Any, what: str) -> None:
    """``save(state, path)``'s checkpoint, loaded by our reader, holds exactly ``state`` (untimed)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    path = os.path.join(work, "check_written")
    save(state, path)
    dist.barrier()  # (the spread save commits on rank 0 alone)
    target = _blank_like(state)
    dcp.load(target, storage_reader=_reader("uring", path))
    _check_loaded(target, state, f"uring ({what})")
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)


def _async_round(state: dict, nbytes: int, work: str, writers: dict, rank: int) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    out = {}
    for name, writer in writers.items():
        path = os.path.join(work, f"async_{name}")
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        dist.barrier()
        t = time.perf_counter()
        resp = dcp.async_save(state, storage_writer=writer, checkpoint_id=path)
        blocked = time.perf_counter() - t
        (resp.upload_completion if hasattr(resp, "upload_completion") else resp).result()
        durable = time.perf_counter() - t
        out[f"async_blocked_s_per_gb/{name}"] = blocked / (nbytes / 1e9)
        out[f"async_durable_s/{name}"] = durable
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
    return out


def worker(rank: int, world: int, init: str, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    work = os.path.join(args.dir, f"n{world}")
    states = {"gpt": _sharded_state(args.size_gb, mesh, seed=0)}
    if args.small:
        states["small"] = _small_state(args.small, states["gpt"][1] // world, rank, world)
        states["floor"] = _small_state(args.small, 4 * args.small, rank, world)  # one element each
    from lightning_recover.checkpoint.dcp.saver import DcpSaver

    for name in (n for n in WRITERS if n != "saver"):  # untimed: engine start-up, thread pools, first-use imports
        dcp.save({"warm": torch.ones(1024)}, storage_writer=_writer(name, os.path.join(work, f"warm_{name}")))
    async_writers = {name: _async_writer(name, os.path.join(work, "async")) for name in ASYNC}
    results: dict[str, Any] = {}
    for kind, (state, nbytes, ntensors) in states.items():
        saver = DcpSaver()  # one per state: its first save (a full dcp.save) caches that state's layout
        for name in WRITERS if args.plan_cache else ["saver"]:
            # untimed: every timed save finds the plan of this state's layout cached (the saver always)
            prime = os.path.join(work, f"prime_{name}")
            _timed_save(name, state, prime, args, saver)
            if rank == 0:
                shutil.rmtree(prime, ignore_errors=True)
        if kind == "gpt":
            _check_written(state, work, rank, _spread_save, "the spread save's checkpoint")  # its first: full
        rounds: list[dict] = []
        for _ in range(args.repeat):
            if kind == "floor":
                rounds.append(_floor_round(state, work, args, saver))
                continue
            r = _one_round(state, nbytes, work, args, rank, saver, spread=kind == "gpt")
            if kind == "gpt":
                r.update(_async_round(state, nbytes, work, async_writers, rank))
            rounds.append(r)
        _check_written(state, work, rank, saver.save, "DcpSaver's checkpoint")
        results[kind] = {"bytes": nbytes, "tensors": ntensors, "rounds": rounds}
    for w in async_writers.values():
        w.close()
    if rank == 0:
        shutil.rmtree(work, ignore_errors=True)
        with open(os.path.join(args.dir, f"result_n{world}.json"), "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def _has_torchsnapshot() -> bool:
    import importlib.util

    if importlib.util.find_spec("torchsnapshot") is None:
        print("torchsnapshot is not installed (pip install torchsnapshot==0.1.0): its baseline is skipped")
        return False
    return True


def _run_world(world: int, args: argparse.Namespace) -> dict:
    init = f"file://{os.path.join(args.dir, f'pg_n{world}_{os.getpid()}')}"
    cmd = [
        sys.executable,
        "-m",
        "lightning_recover.bench.dcp_ranks",
        "--worker",
        "--world",
        str(world),
        "--init",
        init,
        "--dir",
        args.dir,
        "--size-gb",
        str(args.size_gb),
        "--repeat",
        str(args.repeat),
        "--small",
        str(args.small),
        *([] if args.fio else ["--no-fio"]),
        *([] if args.torchsnapshot else ["--no-torchsnapshot"]),
        *(["--plan-cache"] if args.plan_cache else []),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([*cmd, "--rank", str(r)], env=env) for r in range(world)]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise RuntimeError(f"benchmark workers for N={world} failed: exit codes {codes}")
    with open(os.path.join(args.dir, f"result_n{world}.json")) as f:
        return json.load(f)


def _median(rounds: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rounds)


def _paired(rounds: list[dict], num: str, den: str) -> str:
    """Median of the per-round ratios num/den, and their spread: each pair ran back to back."""
    ratios = sorted(r[num] / r[den] for r in rounds if num in r and den in r)
    if not ratios:
        return "-"
    return f"{statistics.median(ratios):.2f}x [{ratios[0]:.2f}-{ratios[-1]:.2f}]"


def summarize(all_results: dict[int, dict], kind: str) -> list[str]:
    """Markdown rows: per N, median GB/s of every contender and the paired ratios."""
    lines = [
        "| N | op | "
        + " | ".join(["ours", "ours DcpSaver", "stock t=1", "stock t=4", "fio", "torchsnapshot"])
        + " | ours/t=1 | ours/t=4 "
        "| ours/fio | DcpSaver/fio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for world, res in sorted(all_results.items()):
        rounds = res[kind]["rounds"]

        def cell(key: str, rounds: list = rounds) -> str:
            return f"{_median(rounds, key):.3f}" if key in rounds[0] else "-"

        lines.append(
            f"| {world} | save | {cell('save/uring')} | {cell('save/saver')} | {cell('save/fsw_t1')} | "
            f"{cell('save/fsw_t4')} | {cell('save/fio')} | {cell('save/torchsnapshot')} | "
            f"{_paired(rounds, 'save/uring', 'save/fsw_t1')} | {_paired(rounds, 'save/uring', 'save/fsw_t4')} | "
            f"{_paired(rounds, 'save/uring', 'save/fio')} | {_paired(rounds, 'save/saver', 'save/fio')} |"
        )
        lines.append(
            f"| {world} | load | {cell('load/uring')} | - | - | {cell('load/fsr')} | {cell('load/fio')} | - | - | "
            f"{_paired(rounds, 'load/uring', 'load/fsr')} | {_paired(rounds, 'load/uring', 'load/fio')} | - |"
        )
    return lines


def summarize_floor(all_results: dict[int, dict]) -> list[str]:
    """Markdown rows: per N, the floor state's save seconds per writer, fio's seconds for the small state's
    bytes, and the ceiling on ours/fio for the small state that the floor leaves (see the module docstring)."""
    lines = [
        "| N | ours s | DcpSaver s | stock t=1 s | stock t=4 s | fio s (small state's bytes) "
        "| ceiling on ours/fio, DcpSaver/fio | ours/fio | DcpSaver/fio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for world, res in sorted(all_results.items()):
        floor, small = res["floor"]["rounds"], res["small"]["rounds"]
        cells = [f"{_median(floor, f'floor_s/{name}'):.3f}" for name in WRITERS]
        if "save/fio" in small[0]:
            fio_s = statistics.median(res["small"]["bytes"] / r["save/fio"] / 1e9 for r in small)
            ceiling = ", ".join(f"{fio_s / (fio_s + _median(floor, f'floor_s/{n}')):.2f}x" for n in ("uring", "saver"))
            tail = [
                f"{fio_s:.3f}",
                ceiling,
                _paired(small, "save/uring", "save/fio"),
                _paired(small, "save/saver", "save/fio"),
            ]
        else:
            tail = ["-", "-", "-", "-"]
        lines.append(f"| {world} | " + " | ".join(cells + tail) + " |")
    return lines


def summarize_spread(all_results: dict[int, dict]) -> list[str]:
    """Markdown rows: per N, the spread save's GB/s (GPT state) beside DcpSaver's and dcp.save's, and its ratios."""
    lines = [
        "| N | spread GB/s | DcpSaver GB/s | dcp.save + ours GB/s | spread/fio | spread/DcpSaver | spread/dcp.save |",
        "|---|---|---|---|---|---|---|",
    ]
    for world, res in sorted(all_results.items()):
        rounds = res["gpt"]["rounds"]
        if "save/spread" not in rounds[0]:
            continue
        lines.append(
            f"| {world} | {_median(rounds, 'save/spread'):.3f} | {_median(rounds, 'save/saver'):.3f} | "
            f"{_median(rounds, 'save/uring'):.3f} | {_paired(rounds, 'save/spread', 'save/fio')} | "
            f"{_paired(rounds, 'save/spread', 'save/saver')} | {_paired(rounds, 'save/spread', 'save/uring')} |"
        )
    return lines


def summarize_async(all_results: dict[int, dict]) -> list[str]:
    lines = [
        "| N | " + " | ".join(f"{n}: blocked s/GB, durable s" for n in ASYNC) + " |",
        "|---" * (len(ASYNC) + 1) + "|",
    ]
    for world, res in sorted(all_results.items()):
        rounds = res["gpt"]["rounds"]
        cells = [
            f"{_median(rounds, f'async_blocked_s_per_gb/{n}'):.3f}, {_median(rounds, f'async_durable_s/{n}'):.2f}"
            for n in ASYNC
        ]
        lines.append(f"| {world} | " + " | ".join(cells) + " |")
    return lines


def main(args: argparse.Namespace) -> int:
    ranks = [int(x) for x in str(args.ranks).split(",")]
    own = args.dir is None
    args.dir = args.dir or tempfile.mkdtemp(prefix="lr_bench_dcp_", dir=os.environ.get("TMPDIR", "/var/tmp"))
    os.makedirs(args.dir, exist_ok=True)
    args.fio = shutil.which("fio") is not None and not getattr(args, "no_fio", False)
    args.torchsnapshot = _has_torchsnapshot() and not getattr(args, "no_torchsnapshot", False)
    args.plan_cache = getattr(args, "plan_cache", False)
    all_results = {}
    try:
        for world in ranks:
            all_results[world] = _run_world(world, args)
    finally:
        if own:
            shutil.rmtree(args.dir, ignore_errors=True)
    first = all_results[ranks[0]]
    print(
        f"sharded DCP checkpoint, GB/s, median of {args.repeat} rounds; ratios: median of the per-round ratios "
        f"[min-max]; state {first['gpt']['bytes'] / 1e9:.2f} GB in {first['gpt']['tensors']} tensors, sharded N ways"
    )
    print("\n".join(summarize(all_results, "gpt")))
    if args.small:
        print(f"\nthe same bytes per rank in {args.small} tensors per rank")
        print("\n".join(summarize(all_results, "small")))
        print(f"\nDCP's per-item floor: a save of {args.small} one-element tensors per rank, seconds (median)")
        print("\n".join(summarize_floor(all_results)))
    print("\nspread save (GPT state): fabric.save with sharded replicas, one replica of N processes")
    print("\n".join(summarize_spread(all_results)))
    print("\nasync save (GPT state)")
    print("\n".join(summarize_async(all_results)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({str(k): v for k, v in all_results.items()}, f, indent=1)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size-gb", type=float, default=1.0)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--small", type=int, default=2048, help="small tensors per rank (0: skip)")
    p.add_argument("--dir", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--no-fio", action="store_true")
    p.add_argument("--no-torchsnapshot", action="store_true")
    p.add_argument(
        "--plan-cache",
        action="store_true",
        help="every writer reuses the last save's plan (ours: CachingSavePlanner; stock: enable_plan_caching)",
    )


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--init", default=None)
    a = ap.parse_args()
    if a.worker:
        a.fio = not a.no_fio
        a.torchsnapshot = not a.no_torchsnapshot
        worker(a.rank, a.world, a.init, a)
        # leave without finalizing: a gloo worker thread may still be freeing the last collective's tensors, and
        # CPython ending it inside that C++ destructor at shutdown is std::terminate (tests/integration/test_dcp.py)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    else:
        sys.exit(main(a))
