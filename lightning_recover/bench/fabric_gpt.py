"""Fabric training of TinyGPT on the standard library's source, as the benchmarks run it.

    python -m lightning_recover.bench.fabric_gpt --strategy recover --replicas 4 --steps 20 --out DIR
    python -m lightning_recover.bench.fabric_gpt --strategy ddp --replicas 4 --steps 20 --out DIR

Both strategies see the same model, data and global batch (``M`` microbatches of ``b`` samples
per optimizer step). With ``ddp`` each rank takes ``M / N`` microbatches per step through
Lightning's DistributedSampler, accumulating without sync except on the last one (the standard
way). Every rank that finishes writes ``DIR/rank{r}.json``: per-step wall times and commit times.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_recover.tiny_gpt import build


def _busy(seconds: float) -> None:
    """Fixed per-microbatch compute budget (see benchmarks/LOG.md: emulated replica capacity)."""
    if seconds > 0:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass


def run_recover(args: argparse.Namespace) -> None:
    from lightning_recover import RecoverStrategy

    data, model, optimizer = build(args)
    model.to(getattr(torch, args.dtype))  # in place: the optimizer keeps the same parameters
    strategy = RecoverStrategy(
        microbatches=args.microbatches,
        heartbeat_timeout=args.heartbeat_timeout,
        heartbeat_interval=None if args.heartbeat_timeout >= 0.5 else args.heartbeat_timeout / 5,
        seed=args.seed,
        exact=args.exact or args.exact_every_other,
    )
    fabric = L.Fabric(strategy=strategy, devices=args.replicas, accelerator="cpu")
    fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)
    model.mark_forward_method("loss")
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)
    records = []
    protocol = fabric.strategy.protocol_replica.protocol
    accumulator = protocol.exact
    holds = dict(item.split(":", 1) for item in args.hold.split(",") if item)
    for step in fabric.strategy.steps(loader, max_steps=args.steps):
        _hold(holds.get(str(step.index)))
        if args.exact_every_other:  # paired inside one job: odd steps exact, even steps the default mode
            protocol.exact = accumulator if step.index % 2 else None
        start, cpu_start = time.perf_counter(), time.process_time()
        for x, y in step:
            fabric.backward(model.loss(x, y))
            _busy(args.busy)
            time.sleep(args.sleep)
        optimizer.step()
        optimizer.zero_grad()
        if not records:  # a benchmark waits for this before it starts newcomers
            os.makedirs(args.out, exist_ok=True)
            open(os.path.join(args.out, f"started{fabric.strategy.replica}"), "w").close()
        s = step.stats
        records.append(
            {
                "step": step.index,
                "seconds": time.perf_counter() - start,
                "cpu_seconds": time.process_time() - cpu_start,  # this process, all its threads
                "committed_at": time.time(),
                "loss": s.loss,
                "live": s.live_replicas,
                "generation": s.generation,
                "recomputed": s.recomputed,
                "recovery_seconds": s.recovery_seconds,
                "decide_seconds": s.decide_seconds,
                "redone": s.redone,
                "boundary_regroup_s": sum(e["seconds"] for e in s.events if e["kind"] == "boundary-regroup"),
                "exact": protocol.exact is not None,
                "max_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,  # peak resident memory so far
            }
        )
    _write(args.out, f"rank{fabric.strategy.replica}", records, model)
    protocol_replica = fabric.strategy.protocol_replica
    if protocol_replica.join_timing:  # a joiner: when it asked, when its state arrived, and the state's size
        state_bytes = sum(
            t.numel() * t.element_size()
            for t in [*model.state_dict().values(), *_tensors(optimizer.state_dict())]
            if isinstance(t, torch.Tensor)
        )
        with open(os.path.join(args.out, f"join{fabric.strategy.replica}.txt"), "w") as f:
            json.dump(dict(protocol_replica.join_timing, state_bytes=state_bytes), f)


def _hold(path: str | None, limit: float = 600.0) -> None:
    """Before a step named in ``--hold``: wait until ``path`` exists (the benchmark's gate, e.g. until the
    newcomers of a growing job asked to join)."""
    deadline = time.monotonic() + limit
    while path and not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)


def _tensors(tree: object) -> list:
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _tensors(v)]
    return [tree]


def run_ddp(args: argparse.Namespace) -> None:
    data, model, optimizer = build(args)
    if args.microbatches % args.replicas:
        raise SystemExit("ddp baseline needs microbatches divisible by replicas")
    per_rank = args.microbatches // args.replicas
    fabric = L.Fabric(strategy="ddp", devices=args.replicas, accelerator="cpu")
    fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)
    model.mark_forward_method("loss")  # DDP must see `loss` as a forward to sync gradients
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=args.batch_size, shuffle=True, drop_last=True))
    it = iter(loader)
    records = []
    for index in range(args.steps):
        start = time.perf_counter()
        total = 0.0
        for k in range(per_rank):
            x, y = next(it)
            with fabric.no_backward_sync(model, enabled=k < per_rank - 1):
                loss = model.loss(x, y) / per_rank
                fabric.backward(loss)
            _busy(args.busy)
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        records.append(
            {"step": index, "seconds": time.perf_counter() - start, "committed_at": time.time(), "loss": total}
        )
    _write(args.out, f"rank{fabric.global_rank}", records, model)


def _write(out: str, name: str, records: list, model: torch.nn.Module) -> None:
    os.makedirs(out, exist_ok=True)
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, os.path.join(out, f"{name}.pt"))
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(records, f)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategy", choices=["recover", "ddp"], default="recover")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--corpus-bytes", type=int, default=2_000_000)
    p.add_argument("--heartbeat-timeout", type=float, default=1.0)
    p.add_argument("--busy", type=float, default=0.0, help="extra busy-wait seconds per microbatch")
    p.add_argument(
        "--sleep", type=float, default=0.0, help="padded compute: seconds slept per microbatch (a replica's capacity)"
    )
    p.add_argument("--hold", default="", help="STEP:PATH,...: before step STEP wait until PATH exists")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--exact", action="store_true", help="recover: RecoverStrategy(exact=True)")
    p.add_argument(
        "--exact-every-other",
        action="store_true",
        help="recover: exact mode on odd steps only (the benchmark's pairing of the two modes inside one job)",
    )
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="recover: parameter dtype")
    p.add_argument("--out", required=True)
    return p


def main() -> None:
    args = parser().parse_args()
    (run_recover if args.strategy == "recover" else run_ddp)(args)


if __name__ == "__main__":
    main()
