"""Training script of the sharded-replica tests: a float64 MLP, FSDP2 inside each replica.

    python tests/scripts/sharded_train.py OUT --replicas 2 --replica-size 2 --steps 4 --microbatches 8
    python tests/scripts/sharded_train.py OUT --reference ...   # one process, unsharded, same M microbatches
    ... --save-step S --ckpt DIR     # fabric.save a sharded DCP checkpoint after S steps, then go on
    ... --resume DIR                 # fabric.load it after setup and continue from the saved step
    python tests/scripts/sharded_train.py OUT --replica-size 2 --tp 2 ...  # tensor parallel inside a replica

Process 0 of every replica that finishes writes OUT/replica{r}.pt (full parameters, per-step
stats); every process writes OUT/pid.r{r}.i{i} at start so tests can check none is left over.
"""

import argparse
import json
import os
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_recover.data import MicrobatchSource


def data_and_model(dtype: str = "float64"):
    torch.manual_seed(0)
    x = torch.randn(512, 16, dtype=torch.float64)
    y = (x @ torch.randn(16, 1, dtype=torch.float64)).tanh() + 0.01 * torch.randn(512, 1, dtype=torch.float64)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
    ).double()
    if dtype == "float32":  # same values, rounded: gloo's float32 path differs from float64's in FSDP2
        return TensorDataset(x.float(), y.float()), model.float()
    return TensorDataset(x, y), model


def parallelize_tp(model, mesh):
    """``--tp``: ColwiseParallel/RowwiseParallel on the MLP's first Linear pair over mesh["tp"]; the
    last Linear (32 -> 1) stays plain, replicated over tp. With a data width K // tp > 1, FSDP2 then
    shards every parameter over mesh["shard"] (2-D: TP parameters become ("shard", "tp") DTensors)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    if mesh["shard"].size() > 1:
        fully_shard(model, mesh=mesh["shard"])
    return model


def reference(args) -> None:
    """Single process, unsharded: each step sums the gradients of the same M microbatches, / M."""
    dataset, model = data_and_model(args.dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    source = MicrobatchSource(dataset, args.batch_size, args.microbatches, shuffle=True, seed=0)
    for step in range(args.steps):
        for j in range(args.microbatches):
            xb, yb = source.batch(step, j)
            torch.nn.functional.mse_loss(model(xb), yb).backward()
        for p in model.parameters():
            p.grad /= args.microbatches
        optimizer.step()
        optimizer.zero_grad()
    os.makedirs(args.out, exist_ok=True)
    torch.save({"state": {k: v.clone() for k, v in model.state_dict().items()}}, os.path.join(args.out, "reference.pt"))


def full_state(model) -> dict:
    # full_tensor() is a collective inside the replica: every process of it calls it.
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.state_dict().items()
    }


def train(args) -> None:
    import lightning as L

    from lightning_recover import RecoverStrategy

    dataset, model = data_and_model(args.dtype)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True)
    strategy = RecoverStrategy(
        microbatches=args.microbatches,
        heartbeat_timeout=args.heartbeat_timeout,
        heartbeat_interval=min(0.1, args.heartbeat_timeout / 5),
        replica_size=args.replica_size,
        restarts=args.restarts,
        **({"tensor_parallel": args.tp, "parallelize_fn": parallelize_tp} if args.tp > 1 else {"shard": "fsdp"}),
    )
    fabric = L.Fabric(strategy=strategy, devices=args.replicas * args.replica_size, accelerator="cpu")
    fabric.launch()
    protocol_replica = fabric.strategy.protocol_replica
    os.makedirs(args.out, exist_ok=True)
    open(os.path.join(args.out, f"pid.r{protocol_replica.replica}.i{protocol_replica.inner}"), "w").write(
        str(os.getpid())
    )

    def ranks() -> list:  # Lightning's numbering as Fabric answers it (one rank per process)
        return [fabric.global_rank, fabric.local_rank, fabric.node_rank, fabric.world_size, fabric.is_global_zero]

    ranks_seen = {"replica": protocol_replica.replica, "inner": protocol_replica.inner, "start": ranks()}
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    start, saved_state = 0, None
    if args.resume:
        ckpt = {"model": model, "optimizer": optimizer, "step": -1}
        rest = fabric.load(args.resume, ckpt)
        assert rest == {}, f"unrequested entries returned: {sorted(rest)}"
        start = ckpt["step"]
    stats = []
    holds = {int(step): path for step, _, path in (item.partition(":") for item in args.hold.split(",") if item)}
    for step in fabric.strategy.steps(loader, max_steps=args.steps, start_step=start):
        for xb, yb in step:
            fabric.backward(torch.nn.functional.mse_loss(model(xb), yb))
        optimizer.step()
        optimizer.zero_grad()
        stats.append(vars(step.stats))
        if args.slow_while_degraded and step.stats.live_replicas < args.replicas:
            time.sleep(args.slow_while_degraded)  # gives a restarted replica time to rejoin before the end
        gate = holds.get(step.index + 1)
        deadline = time.monotonic() + 600  # a newcomer's start under a loaded host's imports can take minutes
        while gate and not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.05)
        if args.save_step == step.index + 1:
            fabric.save(args.ckpt, {"model": model, "optimizer": optimizer, "step": step.index + 1})
            saved_state = full_state(model)
    state = full_state(model)
    local_bytes = sum(
        (p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size() for p in model.parameters()
    )
    local_bytes += sum(
        t.to_local().numel() * t.element_size() if hasattr(t, "to_local") else 0
        for s in optimizer.state.values()
        for t in s.values()
        if torch.is_tensor(t)
    )
    ranks_seen["end"] = ranks()
    with open(os.path.join(args.out, f"ranks.r{protocol_replica.replica}.i{protocol_replica.inner}.json"), "w") as f:
        json.dump(ranks_seen, f)
    if protocol_replica.inner == 0:
        torch.save(
            {
                "state": state,
                "stats": stats,
                "replica": protocol_replica.replica,
                "local_bytes": local_bytes,
                "saved_state": saved_state,
            },
            os.path.join(args.out, f"replica{protocol_replica.replica}.pt"),
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--replica-size", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree inside a replica")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--heartbeat-timeout", type=float, default=2.0)
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--restarts", type=int, default=0, help="restart a failed replica up to N times (rejoin)")
    parser.add_argument("--slow-while-degraded", type=float, default=0.0, help="sleep after a step with a replica down")
    parser.add_argument("--save-step", type=int, default=0)
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--dtype", default="float64", choices=["float64", "float32"])
    parser.add_argument("--hold", default="", help="STEP:PATH,...: before step STEP, wait (<= 600 s) until PATH exists")
    args = parser.parse_args()
    reference(args) if args.reference else train(args)


if __name__ == "__main__":
    main()
