"""Training script used by the resilience tests: a small regression MLP under Fabric.

    python tests/scripts/fabric_train.py OUT_DIR --replicas 4 --steps 6 --microbatches 8
    python tests/scripts/fabric_train.py OUT_DIR --reference --steps 6 --microbatches 8  # one process

Every replica that finishes writes OUT_DIR/replica{r}.pt (final parameters and per-step stats).
``--reference`` is the failure-free run without Lightning, a strategy or other processes: it sums
the gradients of the same M microbatches (same samples, same order) and writes OUT_DIR/reference.pt.
``--exact`` runs ``RecoverStrategy(exact=True)``; its reference is then the exact-mode step in one
process (protocol/exact.py: exact_step_alone), which every replica must equal bitwise.
"""

import argparse
import os
import time

import torch
from torch.utils.data import TensorDataset

from lightning_recover.data import MicrobatchSource


def data_and_model(dtype: str):
    torch.manual_seed(0)
    x = torch.randn(512, 16)
    y = (x @ torch.randn(16, 1)).tanh() + 0.01 * torch.randn(512, 1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    if dtype in ("float64", "bfloat16"):  # the same values, then trained in that dtype
        dt = getattr(torch, dtype)
        return TensorDataset(x.to(dt), y.to(dt)), model.to(dt)
    return TensorDataset(x, y), model


def reference_state(
    steps: int, microbatches: int, batch_size: int = 4, dtype: str = "float32", exact: bool = False
) -> dict:
    """The failure-free run in this process: each step sums the gradients of microbatches 0..M-1
    of the step (the samples the strategy gives them), times 1/M as the strategy's reduce does,
    then the same AdamW step. Returns the final parameters."""
    dataset, model = data_and_model(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    source = MicrobatchSource(dataset, batch_size, microbatches, shuffle=True, seed=0)
    if exact:
        from lightning_recover.protocol.exact import ExactAccumulator, exact_step_alone

        accumulator = ExactAccumulator(microbatches)
        params = list(model.parameters())
        for step in range(steps):

            def backward(j: int, step: int = step) -> torch.Tensor:
                xb, yb = source.batch(step, j)
                loss = torch.nn.functional.mse_loss(model(xb), yb)
                loss.backward()
                return loss

            exact_step_alone(accumulator, params, backward)
            optimizer.step()
            optimizer.zero_grad()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    for step in range(steps):
        for j in range(microbatches):
            xb, yb = source.batch(step, j)
            torch.nn.functional.mse_loss(model(xb), yb).backward()
        for p in model.parameters():
            p.grad.mul_(1.0 / microbatches)
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def reference(args) -> None:
    state = reference_state(args.steps, args.microbatches, args.batch_size, args.dtype, args.exact)
    os.makedirs(args.out, exist_ok=True)
    torch.save({"state": state}, os.path.join(args.out, "reference.pt"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--microbatches", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--heartbeat-timeout", type=float, default=1.0)
    parser.add_argument("--quota", default="equal")
    parser.add_argument("--hang-timeout", type=float, default=30.0)
    parser.add_argument("--accelerator", default="cpu", help="cpu (gloo) or cuda (NCCL, one GPU per replica)")
    parser.add_argument("--work", type=float, default=0.0, help="extra seconds of work per microbatch")
    parser.add_argument(
        "--slow-while-degraded",
        type=float,
        default=0.0,
        help="sleep this long after each step run with fewer than --replicas live replicas "
        "(gives a restarted replica time to rejoin before the run ends)",
    )
    parser.add_argument(
        "--metrics",
        action="store_true",
        help="also all-reduce the loss and pass a barrier every step (store collectives)",
    )
    parser.add_argument(
        "--hold",
        default="",
        help="STEP:PATH,...: before step STEP, wait until PATH exists (at most 600 s); lets a test start a "
        "fault only once a standby is ready",
    )
    parser.add_argument(
        "--standby-hold",
        default="",
        help="ID:PATH,...: standby ID waits until PATH exists (at most 600 s) before it starts, so it is not ready "
        "before the test says",
    )
    parser.add_argument("--save-at", type=int, default=-1, help="after step N, fabric.save to --checkpoint")
    parser.add_argument("--resume", action="store_true", help="fabric.load --checkpoint, go on after its step")
    parser.add_argument("--checkpoint", default="", help="the checkpoint file of --save-at and --resume")
    parser.add_argument(
        "--notice-checkpoint", default=None, help="RecoverStrategy(notice_checkpoint=...): a whole-job notice's save"
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    parser.add_argument("--exact", action="store_true", help="RecoverStrategy(exact=True): bitwise reproducible steps")
    parser.add_argument("--reference", action="store_true", help="the failure-free run in one process (no Lightning)")
    parser.add_argument("--tensorboard", default="", help="log the recover/* metrics to a TensorBoardLogger here")
    args = parser.parse_args()
    reference(args) if args.reference else train(args)


def train(args) -> None:
    import lightning as L
    from torch.utils.data import DataLoader

    import lightning_recover  # noqa: F401  (registers strategy="recover")
    from lightning_recover import RecoverStrategy

    standby_holds = dict(item.split(":", 1) for item in args.standby_hold.split(",") if item)
    gate = standby_holds.get(os.environ.get("LIGHTNING_RECOVER_STANDBY", ""))
    deadline = time.monotonic() + 600
    while gate and not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.05)
    dataset, model = data_and_model(args.dtype)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    strategy = RecoverStrategy(
        microbatches=args.microbatches,
        heartbeat_timeout=args.heartbeat_timeout,
        heartbeat_interval=min(0.1, args.heartbeat_timeout / 5),
        quota=args.quota,
        hang_timeout=args.hang_timeout,
        exact=args.exact,
        notice_checkpoint=args.notice_checkpoint,
    )
    loggers = []
    if args.tensorboard:
        from lightning.fabric.loggers import TensorBoardLogger

        loggers.append(TensorBoardLogger(args.tensorboard, name="tb", version=0))  # one version for every replica
    fabric = L.Fabric(strategy=strategy, devices=args.replicas, accelerator=args.accelerator, loggers=loggers)
    fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)
    os.makedirs(args.out, exist_ok=True)
    stats = []
    holds = {int(item.split(":", 1)[0]): item.split(":", 1)[1] for item in args.hold.split(",") if item}
    start_step = 0
    if args.resume:
        start_step = fabric.load(args.checkpoint, {"model": model, "optimizer": optimizer})["step"] + 1
    for step in fabric.strategy.steps(loader, max_steps=args.steps, start_step=start_step, loggers=fabric.loggers):
        for xb, yb in step:
            if args.work:
                time.sleep(args.work)
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if args.metrics:
            fabric.all_reduce(torch.tensor(step.loss), reduce_op="mean")
            fabric.barrier()
        stats.append(vars(step.stats))
        if step.index == args.save_at:
            fabric.save(args.checkpoint, {"model": model, "optimizer": optimizer, "step": step.index})
        with open(os.path.join(args.out, f"steps{fabric.strategy.replica}.log"), "a") as f:
            f.write(f"{step.index}\n")  # every step this replica applied, written as it happens
        if args.slow_while_degraded and step.stats.live_replicas < args.replicas:
            time.sleep(args.slow_while_degraded)
        if step.index == 0:
            open(os.path.join(args.out, "started"), "w").close()
        gate = holds.get(step.index + 1)
        deadline = time.monotonic() + 600  # a newcomer's start under a loaded host's imports can take minutes
        while gate and not os.path.exists(gate) and time.monotonic() < deadline:
            if (
                fabric.strategy.protocol_replica.notice.is_set()
            ):  # a test may wait for the notice to reach every replica
                open(os.path.join(args.out, f"notice{fabric.strategy.replica}"), "a").close()
            time.sleep(0.05)
    for logger in fabric.loggers:
        logger.finalize("success")  # Fabric leaves this to the script: it flushes what the writer still holds
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    os.makedirs(args.out, exist_ok=True)
    torch.save(
        {"state": state, "stats": stats, "replica": fabric.strategy.replica},
        os.path.join(args.out, f"replica{fabric.strategy.replica}.pt"),
    )


if __name__ == "__main__":
    main()
