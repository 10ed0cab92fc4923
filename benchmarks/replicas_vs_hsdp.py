"""Sharded replicas vs Lightning's stock ModelParallelStrategy (native FSDP2 HSDP), CPU/gloo.

    python -m benchmarks.replicas_vs_hsdp --pairs 3 --steps 12   # writes JSON to stdout

Both modes train the same MLP of ``--blocks`` blocks on R*K = 4 processes with the same M
microbatches per step (M/4 per process): ``recover`` = ``RecoverStrategy(replica_size=2,
shard="fsdp")`` with ``devices=4`` (2 replicas x 2); ``native`` = ``ModelParallelStrategy`` whose
parallelize_fn fully_shards every block over the 2-D (replicate, shard) mesh (HSDP), reducing once
per step (``no_backward_sync`` on all but the last microbatch); ``recover`` reduce-scatters inside
the replica after every microbatch and all-reduces across replicas once per step. Runs alternate
(paired) because this machine's 2 cores are shared; the ratio is the median of paired ratios. Also
measured: recovery latency (SIGKILL of one process of replica 1 in backward -> the survivors' next
commit) and per-process parameter + optimizer bytes vs unsharded.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _model(blocks: int, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(
        torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh()) for _ in range(blocks)
    )
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))


def _data(width: int, n: int = 4096):
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, width, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True).tanh())


def _local_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    total = sum(local(p).numel() * p.element_size() for p in model.parameters())
    for state in optimizer.state.values():
        total += sum(local(t).numel() * t.element_size() for t in state.values() if torch.is_tensor(t) and t.dim())
    return total


def worker(args: argparse.Namespace) -> None:
    """One process of either mode; rank 0 (of replica 0) writes the timings to ``args.out``."""
    import lightning as L
    from torch.utils.data import DataLoader

    model = _model(args.blocks, args.width)
    unsharded = sum(p.numel() * p.element_size() for p in model.parameters()) * 3  # params + 2 Adam moments
    dataset = _data(args.width)
    M = args.microbatches
    times: list[float] = []
    commits: list[float] = []
    if args.mode == "recover":
        from lightning_recover import RecoverStrategy

        strategy = RecoverStrategy(microbatches=M, replica_size=2, shard="fsdp", heartbeat_timeout=2.0)
        fabric = L.Fabric(strategy=strategy, devices=4, accelerator="cpu")
        fabric.launch()
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
        loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True)
        protocol_replica = fabric.strategy.protocol_replica
        writer = protocol_replica.inner == 0 and protocol_replica.replica == 0
        for step in fabric.strategy.steps(loader, max_steps=args.steps):
            start = time.perf_counter()
            for xb, yb in step:
                fabric.backward(torch.nn.functional.mse_loss(model(xb), yb))
            commits.append(time.time())
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - start)
    else:
        from lightning.fabric.strategies import ModelParallelStrategy
        from torch.distributed.fsdp import fully_shard

        def parallelize(module: torch.nn.Module, mesh) -> torch.nn.Module:
            # HSDP: dim 0 replicates, dim 1 shards (stock FSDP2 over a 2-D mesh).
            for block in module[:-1]:
                fully_shard(block, mesh=mesh)
            return fully_shard(module, mesh=mesh)

        strategy = ModelParallelStrategy(parallelize, data_parallel_size=2, tensor_parallel_size=2)
        fabric = L.Fabric(strategy=strategy, devices=4, accelerator="cpu")
        fabric.launch()
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
        writer = fabric.global_rank == 0
        per = M // fabric.world_size
        g = torch.Generator().manual_seed(0)
        for step in range(args.steps):
            start = time.perf_counter()
            for k in range(per):
                idx = torch.randint(0, len(dataset), (args.batch_size,), generator=g)
                xb, yb = dataset[idx]
                # Stock practice: reduce (reduce-scatter + replicate all-reduce) once per step.
                with fabric.no_backward_sync(model, enabled=k < per - 1):
                    fabric.backward(torch.nn.functional.mse_loss(model(xb), yb))
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - start)
            commits.append(time.time())
    if writer:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "times": times,
                    "commits": commits,
                    "local_bytes": _local_bytes(model, optimizer),
                    "unsharded_bytes": unsharded,
                },
                f,
            )


def _run(mode: str, args: argparse.Namespace, inject: str | None = None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.replicas_vs_hsdp",
            "--worker",
            mode,
            "--out",
            out,
            "--steps",
            str(args.steps),
            "--blocks",
            str(args.blocks),
            "--width",
            str(args.width),
            "--microbatches",
            str(args.microbatches),
            "--batch-size",
            str(args.batch_size),
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        # benchmarks/ is not installed: the workers find it (and this checkout) through the repo root
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_ROOT, env.get("PYTHONPATH")]))
        env.pop("LIGHTNING_RECOVER_INJECT", None)
        if inject:
            env["LIGHTNING_RECOVER_INJECT"] = inject
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, start_new_session=True)
        if not os.path.exists(out):
            raise RuntimeError(f"{mode} run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        result = json.load(open(out))
        fault = re.search(r"injecting fault .* at t=([0-9.]+)", proc.stdout + proc.stderr)
        if fault:
            t = float(fault.group(1))
            result["recovery_s"] = min(c for c in result["commits"] if c > t) - t
        return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.replicas_vs_hsdp")
    parser.add_argument("--worker", choices=["recover", "native"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--kills", type=int, default=2, help="recovery-latency runs")
    args = parser.parse_args(argv)
    if args.worker:
        args.mode = args.worker
        worker(args)
        return 0
    warm = 2  # the first steps include FSDP's lazy init
    rows = []
    for _ in range(args.pairs):
        r, n = _run("recover", args), _run("native", args)
        mr, mn = statistics.median(r["times"][warm:]), statistics.median(n["times"][warm:])
        rows.append({"recover_s": mr, "native_s": mn, "ratio": mr / mn})
    kills = [
        _run("recover", args, inject=f"kill:replica=1:inner=1:step={args.steps // 2}:phase=backward")["recovery_s"]
        for _ in range(args.kills)
    ]
    print(
        json.dumps(
            {
                "config": vars(args),
                "pairs": rows,
                "median_ratio": statistics.median(x["ratio"] for x in rows),
                "recovery_s": kills,
                "local_bytes": r["local_bytes"],
                "native_local_bytes": n["local_bytes"],
                "unsharded_bytes": r["unsharded_bytes"],
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
