"""Durable sharded DCP save with N processes: UringStorageWriter vs FileSystemWriter vs fio.

    lightning-recover bench checkpoint --ranks 1,2,4 [--size-gb 1] [--repeat 3] [--small 2048] [--json OUT]

For each N, N processes (gloo, one host) hold the same GPT-like training state (parameters +
AdamW moments, fp32, ``gpt_state.config_for_size``) sharded N ways (``Shard(0)`` DTensors over a
1-D CPU mesh, as FSDP2 holds them) and save it with ``dcp.save``: ``UringStorageWriter`` (ours),
``FileSystemWriter(thread_count=1)`` (DCP's default) and ``FileSystemWriter(thread_count=4)``, all
durable (fdatasync / fsync, DCP's default ``sync_files=True``). Then fio writes the same bytes:
``--numjobs=N --bs=16M --direct=1 --ioengine=io_uring --end_fsync=1`` (one file per job). Every
round runs each contender once (after one untimed tiny save with each); the median of the rounds is
reported. GB/s = state bytes / wall
time of ``dcp.save`` on rank 0 from a barrier to its return (planning, writing, fsync and the
commit included); fio = bytes it wrote / wall time of the fio process. A second state of many small
tensors (``--small`` per rank, 16 KiB each, not sharded: rank-private keys) measures per-item costs.
"""

from __future__ import annotations

import argparse
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

WRITERS = ("uring", "fsw_t1", "fsw_t4")
SMALL_BYTES = 16 << 10


def _writer(name: str, path: str) -> Any:
    from torch.distributed.checkpoint import FileSystemWriter

    from lightning_recover.checkpoint import UringStorageWriter

    if name == "uring":
        return UringStorageWriter(path)
    return FileSystemWriter(path, thread_count=int(name.split("_t")[1]))


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


def _small_state(count: int, rank: int, world: int) -> tuple[dict, int, int]:
    import torch

    gen = torch.Generator().manual_seed(rank)
    state = {f"r{rank}.t{i}": torch.rand(SMALL_BYTES // 4, generator=gen) for i in range(count)}
    return state, count * SMALL_BYTES * world, count * world


def _fio(directory: str, nbytes: int, jobs: int) -> float:
    per_job = -(-nbytes // jobs // (16 << 20)) * (16 << 20)
    cmd = [
        "fio",
        "--name=w",
        f"--directory={directory}",
        "--rw=write",
        "--bs=16M",
        "--direct=1",
        "--ioengine=io_uring",
        f"--numjobs={jobs}",
        f"--size={per_job}",
        "--end_fsync=1",
        "--group_reporting",
        "--output-format=json",
    ]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"fio failed: {proc.stderr.strip() or proc.stdout.strip()}")
    doc = json.loads(proc.stdout[proc.stdout.index("{") :])
    return int(doc["jobs"][0]["write"]["io_bytes"]) / wall / 1e9


def worker(rank: int, world: int, init: str, args: argparse.Namespace) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    work = os.path.join(args.dir, f"n{world}")
    target = os.path.join(work, "ck")
    fio_dir = os.path.join(work, "fio")
    states = {"gpt": _sharded_state(args.size_gb, mesh, seed=0)}
    if args.small:
        states["small"] = _small_state(args.small, rank, world)
    import torch

    for name in WRITERS:  # untimed: engine start-up, thread pools, first-use imports
        dcp.save({"warm": torch.ones(1024)}, storage_writer=_writer(name, os.path.join(work, "warm")))
    results: dict[str, Any] = {}
    for kind, (state, nbytes, ntensors) in states.items():
        rounds: dict[str, list[float]] = {w: [] for w in WRITERS}
        if args.fio:
            rounds["fio"] = []
        for _ in range(args.repeat):
            for name in WRITERS:
                if rank == 0:
                    shutil.rmtree(target, ignore_errors=True)
                    os.sync()
                dist.barrier()
                t = time.perf_counter()
                dcp.save(state, storage_writer=_writer(name, target))
                rounds[name].append(nbytes / (time.perf_counter() - t) / 1e9)
            if args.fio:
                if rank == 0:
                    shutil.rmtree(fio_dir, ignore_errors=True)
                    os.makedirs(fio_dir)
                    os.sync()
                    rounds["fio"].append(_fio(fio_dir, nbytes, world))
                    shutil.rmtree(fio_dir, ignore_errors=True)
                dist.barrier()
        results[kind] = {"bytes": nbytes, "tensors": ntensors, "gbps": rounds}
    if rank == 0:
        shutil.rmtree(work, ignore_errors=True)
        with open(os.path.join(args.dir, f"result_n{world}.json"), "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


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
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([*cmd, "--rank", str(r)], env=env) for r in range(world)]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise RuntimeError(f"benchmark workers for N={world} failed: exit codes {codes}")
    with open(os.path.join(args.dir, f"result_n{world}.json")) as f:
        return json.load(f)


def _table(all_results: dict[int, dict], kind: str) -> list[str]:
    lines = []
    for world, res in sorted(all_results.items()):
        r = res[kind]
        med = {k: statistics.median(v) for k, v in r["gbps"].items()}
        cells = "  ".join(f"{k} {med[k]:.3f} ({' '.join(f'{x:.3f}' for x in v)})" for k, v in r["gbps"].items())
        ratios = "  ".join(f"uring/{k} {med['uring'] / med[k]:.2f}x" for k in med if k != "uring")
        lines.append(f"  N={world}: {cells}\n        {ratios}")
    return lines


def main(args: argparse.Namespace) -> int:
    ranks = [int(x) for x in str(args.ranks).split(",")]
    own = args.dir is None
    args.dir = args.dir or tempfile.mkdtemp(prefix="lr_bench_dcp_", dir=os.environ.get("TMPDIR", "/var/tmp"))
    os.makedirs(args.dir, exist_ok=True)
    args.fio = shutil.which("fio") is not None and not getattr(args, "no_fio", False)
    all_results = {}
    try:
        for world in ranks:
            all_results[world] = _run_world(world, args)
    finally:
        if own:
            shutil.rmtree(args.dir, ignore_errors=True)
    first = all_results[ranks[0]]
    print(
        f"durable dcp.save, GB/s, median of {args.repeat} (rounds); state {first['gpt']['bytes'] / 1e9:.2f} GB "
        f"in {first['gpt']['tensors']} tensors, sharded N ways"
    )
    print("\n".join(_table(all_results, "gpt")))
    if args.small:
        print(f"many small tensors: {args.small} x {SMALL_BYTES // 1024} KiB per rank")
        print("\n".join(_table(all_results, "small")))
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
        worker(a.rank, a.world, a.init, a)
    else:
        sys.exit(main(a))
