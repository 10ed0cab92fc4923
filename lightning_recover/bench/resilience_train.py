"""The training job of the resilience benchmark, in both of its forms.

    # this project: Fabric strategy="recover" (faults from LIGHTNING_RECOVER_INJECT); a killed
    # replica is restarted by torchrun (one agent per replica) and rejoins with live state ...
    lightning-recover torchrun --replicas 4 --max-restarts 3 --heartbeat-timeout 5 --inject kill:... -- \
        -m lightning_recover.bench.resilience_train --mode recover --replicas 4 --steps 40 --out DIR
    # ... or by the local launcher (fabric.launch() supervises; RecoverStrategy(restarts=K))
    python -m lightning_recover.bench.resilience_train --mode recover --restarts 3 --replicas 4 --steps 40 --out DIR
    # checkpoint-and-restart: Fabric strategy="ddp" (gloo), one process per rank, under torchrun
    torchrun --standalone --nproc-per-node 4 --max-restarts 3 -m lightning_recover.bench.resilience_train \\
        --mode ddp --replicas 4 --steps 40 --ckpt-dir CK --ckpt-every 10 --ckpt-io torch --kill 1:5,2:16 --out DIR

Both train TinyGPT on the standard library's source with the same seed, the same ``M`` microbatches
per optimizer step and the *same* microbatch contents (:class:`~lightning_recover.data.MicrobatchSource`):
under ``ddp`` rank ``r`` computes microbatches ``r*M/N .. (r+1)*M/N - 1`` of each step, so a
failure-free DDP run, a resumed DDP run and a ``recover`` run all follow one trajectory (up to
summation order; the benchmark runs in float64 so that this shows as ~1e-12).

Fixed per-replica capacity: with ``--mb-seconds T`` every microbatch takes ``max(compute, T)`` of
wall time (the replica sleeps for the rest), so a replica processes at most one microbatch per
``T`` seconds however many others are alive. On a small shared machine a killed process would
otherwise free CPU for the survivors and flatter them; with the padding the step time is
``ceil(M / live) * T`` plus communication, as on a cluster of fixed-speed accelerators.

Stragglers (``--slow R:F[@S]``): replica ``R`` pads each microbatch to ``F * max(compute, T)`` instead
(from step ``S`` on), a slower accelerator, ``F`` times slower than the others even on a loaded host; under
``recover``, ``--quota throughput`` gives it fewer of the ``M`` microbatches (``strategy="recover"``'s
quotas proportional to each replica's measured rate).

The ``ddp`` fault hook (``--kill R:S,...``, sorted by step) is this baseline's own: the k-th entry
SIGKILLs rank ``R`` at the start of step ``S``'s backward pass only in attempt ``k``
(``TORCHELASTIC_RESTART_COUNT``), so after a restart the run does not fail at the same place again.
Checkpoints are written every ``--ckpt-every`` steps (after steps K-1, 2K-1, ...) with
``fabric.save`` (ModelCheckpoint's ``every_n_train_steps`` without the Trainer), through Lightning's
default ``TorchCheckpointIO`` (``--ckpt-io torch``) or :class:`UringCheckpointIO` (``--ckpt-io uring``);
a (re)started attempt resumes from the newest one.

Every rank appends JSON lines to ``DIR/rank{r}.jsonl``: ``start`` (process start), ``resume``,
``step`` (start/commit wall times, loss, live replicas, recomputed microbatches), ``ckpt``; under
``recover`` every record also carries the replica's ``incarnation`` (1 = first start), and a
restarted replica logs ``rejoin`` (when it holds the live state and the step to resume at); rank 0
(or the lowest live replica) writes the final parameters to ``DIR/final.pt``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

PROCESS_START = time.time()


def pad_microbatch(start: float, seconds: float, factor: float = 1.0) -> None:
    """Sleep until ``factor * max(compute, seconds)`` after ``start``: the fixed per-microbatch capacity,
    ``factor`` times as long on a straggler. The factor scales the compute too: on a loaded host a microbatch
    may outlast ``seconds``, and a straggler stays ``factor`` times slower than the others even then."""
    took = time.perf_counter() - start
    left = factor * max(took, seconds) - took
    if left > 0:
        time.sleep(left)


def parse_slow(spec: str) -> dict[int, tuple[float, int]]:
    """``--slow``: ``"R:F[@S],..."`` -> ``{R: (F, S)}``: replica ``R``'s microbatches take ``F`` times
    as long as the others' from step ``S`` on (``S`` = 0 when omitted: slow from the start)."""
    slow: dict[int, tuple[float, int]] = {}
    for item in (x.strip() for x in spec.split(",") if x.strip()):
        try:
            replica, rest = item.split(":")
            factor, _, step = rest.partition("@")
            r, f, s = int(replica), float(factor), int(step or 0)
        except ValueError:
            raise ValueError(
                f"--slow {item!r}: expected REPLICA:FACTOR or REPLICA:FACTOR@STEP, e.g. 1:2.0@10"
            ) from None
        if r < 0 or not f >= 1.0 or f == float("inf") or s < 0 or r in slow:
            raise ValueError(
                f"--slow {item!r}: the replica must be >= 0 and appear once, the factor finite and >= 1, the step >= 0"
            )
        slow[r] = (f, s)
    return slow


def slow_factor(slow: dict[int, tuple[float, int]], replica: int, step: int) -> float:
    """How many times as long as the others' one microbatch of ``replica`` takes in ``step``."""
    factor, since = slow.get(replica, (1.0, 0))
    return factor if step >= since else 1.0


def build_job(args: argparse.Namespace):
    import torch

    from lightning_recover.data import MicrobatchSource
    from lightning_recover.tiny_gpt import ByteCorpus, GPTConfig, TinyGPT, stdlib_text

    torch.manual_seed(args.seed)
    data = ByteCorpus(stdlib_text(args.corpus_bytes), args.block_size)
    model = TinyGPT(GPTConfig(block_size=args.block_size, n_layer=args.layers, n_embd=args.width, n_head=4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    source = MicrobatchSource(data, args.batch_size, args.microbatches, shuffle=True, seed=args.seed)
    return data, model, optimizer, source


class RecordLog:
    def __init__(self, out: str, name: str) -> None:
        os.makedirs(out, exist_ok=True)
        self.f = open(os.path.join(out, f"{name}.jsonl"), "a")

    def __call__(self, **rec) -> None:
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()


def run_recover(args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from lightning_recover import RecoverStrategy

    data, model, optimizer, _ = build_job(args)
    K = args.replica_size
    sharding = {"replica_size": K, "shard": "fsdp"} if K > 1 else {}
    # restarts: used when this script launches its own replicas (fabric.launch() supervises them);
    # under `lightning-recover torchrun --max-restarts K` the torchrun agents restart them instead.
    strategy = RecoverStrategy(
        microbatches=args.microbatches,
        heartbeat_timeout=args.heartbeat_timeout,
        heartbeat_interval=None if args.heartbeat_timeout >= 0.5 else args.heartbeat_timeout / 5,
        seed=args.seed,
        restarts=args.restarts,
        standby=args.standby,
        quota=args.quota,
        **sharding,
    )
    fabric = L.Fabric(strategy=strategy, devices=args.replicas * K, accelerator="cpu", precision=args.precision)
    fabric.launch()
    if K > 1:  # sharded replicas: shard first, then build the optimizer over the shards
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=args.lr))
    else:
        model, optimizer = fabric.setup(model, optimizer)
    # the same samples as MicrobatchSource(seed) in build_job: the strategy builds it from this loader
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)
    replica = fabric.strategy.replica
    incarnation = fabric.strategy.protocol_replica.incarnation
    joining = fabric.strategy.protocol_replica.joining  # a restarted replica: steps() first rejoins (state from a peer)
    # One record file per replica (its process 0 writes it; the others of a sharded replica do not).
    log = RecordLog(args.out, f"rank{replica}") if fabric.strategy.protocol_replica.inner == 0 else (lambda **rec: None)
    # attempt stays 0: the run is one attempt (no step is rolled back); incarnation tells restarts apart
    log(event="start", t=PROCESS_START, attempt=0, incarnation=incarnation, ready=time.time())
    slow = parse_slow(args.slow)
    for step in fabric.strategy.steps(loader, max_steps=args.steps):
        start = time.time()
        if joining:
            joining = False
            log(event="rejoin", step=step.index, t=start, incarnation=incarnation, attempt=0)
        factor = slow_factor(slow, replica, step.index)
        for x, y in step:
            t = time.perf_counter()
            fabric.backward(model.loss(x, y))
            pad_microbatch(t, args.mb_seconds, factor)
        optimizer.step()
        optimizer.zero_grad()
        s = step.stats
        log(
            event="step",
            step=step.index,
            start=start,
            commit=time.time(),
            loss=s.loss,
            live=s.live_replicas,
            computed=s.computed,
            recomputed=s.recomputed,
            recovery_seconds=s.recovery_seconds,
            attempt=0,
            incarnation=incarnation,
        )
    # full_tensor() gathers a sharded replica's parameters: a collective of all its processes.
    final = {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.state_dict().items()
    }
    if step.stats.leader and fabric.strategy.protocol_replica.inner == 0:
        torch.save(final, os.path.join(args.out, "final.pt"))


def _hsdp_strategy(replicas: int, replica_size: int):
    """The stock baseline for sharded replicas: Lightning's ModelParallelStrategy with FSDP2 over a
    2-D (replicate, shard) mesh (HSDP); its checkpoints are DCP directories written by every rank."""
    from lightning.fabric.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    def parallelize(module, mesh):
        for block in module.blocks:
            fully_shard(block, mesh=mesh)  # dim 0 replicates, dim 1 shards
        return fully_shard(module, mesh=mesh)

    return ModelParallelStrategy(parallelize, data_parallel_size=replicas, tensor_parallel_size=replica_size)


def _latest_checkpoint(directory: str) -> tuple[int, str] | None:
    best = None
    if os.path.isdir(directory):
        for name in os.listdir(directory):
            if name.startswith("step-") and name.endswith(".ckpt"):
                step = int(name[5:-5])
                if best is None or step > best[0]:
                    best = (step, os.path.join(directory, name))
    return best


def run_ddp(args: argparse.Namespace) -> None:
    import lightning as L
    import torch

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # Under torchrun (torch 2.13, c10d rendezvous) the restarted workers reuse the agent's store,
        # which still holds the previous attempt's gloo addresses: connectFullMesh then dials dead
        # ports ("Connection refused"). A fresh store per attempt, hosted by rank 0, avoids that.
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"
        os.environ["MASTER_PORT"] = str(int(os.environ["MASTER_PORT"]) + 1 + attempt)
    kills = sorted(((int(s), int(r)) for r, s in (item.split(":") for item in args.kill.split(",") if item)))
    plugins = []
    if args.ckpt_io == "uring":
        from lightning_recover.lightning.checkpoint_io import UringCheckpointIO

        plugins.append(UringCheckpointIO())
    data, model, optimizer, source = build_job(args)
    K = args.replica_size
    ranks = args.replicas * K
    if args.microbatches % ranks:
        raise SystemExit("the checkpoint-and-restart baseline needs microbatches divisible by replicas x replica size")
    per_rank = args.microbatches // ranks
    if K > 1 and plugins:
        raise SystemExit("--ckpt-io uring is the single-file plugin; the HSDP baseline writes DCP directories")
    strategy = _hsdp_strategy(args.replicas, K) if K > 1 else "ddp"
    fabric = L.Fabric(strategy=strategy, devices=ranks, accelerator="cpu", precision=args.precision, plugins=plugins)
    fabric.launch()
    rank = fabric.global_rank
    # Replica r of the schedule is ranks r*K .. r*K+K-1; one record file per replica, by its first rank.
    log = RecordLog(args.out, f"rank{rank // K}") if rank % K == 0 else (lambda **rec: None)
    log(event="start", t=PROCESS_START, attempt=attempt)
    if K > 1:
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=args.lr))
    else:
        model, optimizer = fabric.setup(model, optimizer)
        model.mark_forward_method("loss")  # the loss is computed through DDP's forward (gradient sync hooks)
    first = 0
    latest = _latest_checkpoint(args.ckpt_dir)
    if latest is not None:
        t = time.time()
        state = {"model": model, "optimizer": optimizer, "step": 0}
        fabric.load(latest[1], state)
        first = state["step"]
        log(event="resume", step=first, seconds=time.time() - t, t=time.time(), attempt=attempt)
    fault = kills[attempt] if attempt < len(kills) else None
    slow = parse_slow(args.slow)
    for index in range(first, args.steps):
        start = time.time()
        total = 0.0
        factor = slow_factor(slow, rank // K, index)
        for k in range(per_rank):
            t = time.perf_counter()
            x, y = source.batch(index, rank * per_rank + k)
            with fabric.no_backward_sync(model, enabled=k < per_rank - 1):
                loss = model.loss(x, y)
                if fault == (index, rank // K) and rank % K == 0 and k == 0:
                    print(
                        f"[ddp-restart] injecting fault kill:rank={rank // K}:step={index}:phase=backward "
                        f"at t={time.time():.6f}",
                        flush=True,
                    )
                    os.kill(os.getpid(), signal.SIGKILL)
                fabric.backward(loss / per_rank)
            total += loss.item()
            pad_microbatch(t, args.mb_seconds, factor)
        optimizer.step()
        optimizer.zero_grad()
        log(
            event="step",
            step=index,
            start=start,
            commit=time.time(),
            loss=total / per_rank,
            live=args.replicas,
            computed=per_rank,
            attempt=attempt,
        )
        if args.ckpt_every and (index + 1) % args.ckpt_every == 0 and index + 1 < args.steps:
            t = time.time()
            fabric.save(
                os.path.join(args.ckpt_dir, f"step-{index + 1}.ckpt"),
                {"model": model, "optimizer": optimizer, "step": index + 1},
            )
            fabric.barrier()
            log(event="ckpt", step=index + 1, seconds=time.time() - t, attempt=attempt)
    final = {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.state_dict().items()
    }
    if rank == 0:
        torch.save(final, os.path.join(args.out, "final.pt"))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["recover", "ddp"], required=True)
    add_job_arguments(p)
    return p


def add_job_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments every form of the job takes (also ``torchft_train.py``'s)."""
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument(
        "--replica-size", type=int, default=1, help="K > 1: sharded replicas (FSDP2 over K processes per replica)"
    )
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--microbatches", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--corpus-bytes", type=int, default=2_000_000)
    p.add_argument("--precision", default="64-true")
    p.add_argument("--mb-seconds", type=float, default=0.0, help="fixed wall time per microbatch (capacity)")
    p.add_argument(
        "--slow",
        default="",
        help="stragglers: R:F[@S],... replica R's microbatches take F x --mb-seconds (from step S on)",
    )
    p.add_argument("--quota", choices=["equal", "throughput"], default="equal", help="recover: microbatch quotas")
    p.add_argument("--heartbeat-timeout", type=float, default=1.0)
    p.add_argument(
        "--restarts",
        type=int,
        default=0,
        help="recover, self-launched: the local launcher restarts a failed replica up to K times",
    )
    p.add_argument(
        "--standby", type=int, default=0, help="recover, self-launched: S warm standbys take failed replicas' places"
    )
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--ckpt-io", choices=["torch", "uring"], default="torch")
    p.add_argument("--kill", default="", help="ddp: R:S,... rank R is SIGKILLed at step S (k-th entry in attempt k)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)


def main() -> None:
    args = parser().parse_args()
    (run_recover if args.mode == "recover" else run_ddp)(args)


if __name__ == "__main__":
    main()
