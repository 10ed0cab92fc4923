"""Training script of tests/integration/test_sharded_trainer.py: the sharded_train.py MLP under the Trainer.

    python tests/scripts/sharded_trainer_train.py OUT --replicas 2 --replica-size 2 --steps 4 --microbatches 8

``RecoverTrainerStrategy(replica_size=K)`` with the model built in ``configure_model`` and sharded
by the strategy (``--parallelize fsdp``: ``shard="fsdp"``; ``fn``: a ``parallelize_fn``). The data,
the model and the microbatch layout are those of ``sharded_train.py``, so its ``--reference`` run
(one process, unsharded) is the ground truth. Process 0 of every replica that finishes writes
OUT/replica{r}.pt (full parameters, per-step stats); every process writes OUT/pid.r{r}.i{i} at start.

    ... --ckpt-every N   # ModelCheckpoints every N steps: OUT/keep (every one kept) and OUT/latest
                         # (top 1 by step: the previous one removed; save_last: last.ckpt overwritten)
    ... --resume DIR     # trainer.fit(..., ckpt_path=DIR): a sharded checkpoint directory
"""

import argparse
import os
import sys

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sharded_train import data_and_model  # noqa: E402  (same data and model as the Fabric script)
from trainer_train import Hold  # noqa: E402  (the same --hold as the unsharded Trainer script)

from lightning_recover import RecoverTrainerStrategy  # noqa: E402


def parallelize(module, mesh):
    """A ModelParallelStrategy-style parallelize_fn: each Linear, then the network."""
    from torch.distributed.fsdp import fully_shard

    for layer in module.net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh["shard"])
    fully_shard(module.net, mesh=mesh["shard"])
    return module


class Regressor(L.LightningModule):
    def __init__(self, out: str) -> None:
        super().__init__()
        self.out = out
        self.net = None

    def configure_model(self) -> None:
        if self.net is None:
            _, self.net = data_and_model("float64")  # the same initial weights as the reference
            protocol_replica = self.trainer.strategy.protocol_replica
            with open(os.path.join(self.out, f"pid.r{protocol_replica.replica}.i{protocol_replica.inner}"), "w") as f:
                f.write(str(os.getpid()))

    def training_step(self, batch, batch_idx):
        x, y = batch  # ONE microbatch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--replica-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--heartbeat-timeout", type=float, default=2.0)
    parser.add_argument("--parallelize", default="fsdp", choices=["fsdp", "fn"])
    parser.add_argument("--restarts", type=int, default=0, help="restart a failed replica up to N times (rejoin)")
    parser.add_argument("--ckpt-every", type=int, default=0, help="ModelCheckpoint every N steps (sharded DCP dirs)")
    parser.add_argument("--resume", default=None, help="fit(ckpt_path=...) from this sharded checkpoint directory")
    parser.add_argument(
        "--hold",
        default="",
        help="STEP:PATH,...: before optimizer step STEP (global_step == STEP), wait until PATH exists (at most 600 s)",
    )
    args = parser.parse_args()

    os.makedirs(args.out, exist_ok=True)
    dataset, _ = data_and_model("float64")
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True)
    shard = {"shard": "fsdp"} if args.parallelize == "fsdp" else {"parallelize_fn": parallelize}
    strategy = RecoverTrainerStrategy(
        microbatches=args.microbatches,
        heartbeat_timeout=args.heartbeat_timeout,
        heartbeat_interval=min(0.1, args.heartbeat_timeout / 5),
        replica_size=args.replica_size,
        restarts=args.restarts,
        **shard,
    )
    callbacks = [Hold(args.hold)]
    if args.ckpt_every:
        every = {"every_n_train_steps": args.ckpt_every, "filename": "{step}"}
        callbacks.append(ModelCheckpoint(dirpath=os.path.join(args.out, "keep"), save_top_k=-1, **every))
        latest = os.path.join(args.out, "latest")  # monitor: another state_key than the first one's
        callbacks.append(ModelCheckpoint(dirpath=latest, monitor="step", mode="max", save_last=True, **every))
    trainer = L.Trainer(
        strategy=strategy,
        devices=args.replicas * args.replica_size,
        accelerator="cpu",
        # The default precision leaves the float64 model and data as they are; "64-true" would build the
        # model with float64 as the default dtype, i.e. other initial weights than the reference's.
        max_steps=args.steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(args.ckpt_every),
        callbacks=callbacks,
    )
    model = Regressor(args.out)
    trainer.fit(model, loader, ckpt_path=args.resume)
    # Only replicas reach this line. full_tensor() is a collective inside the replica: all K call it.
    protocol_replica = trainer.strategy.protocol_replica
    state = {k.removeprefix("net."): v.full_tensor().detach().clone() for k, v in model.state_dict().items()}
    if protocol_replica.inner == 0:
        torch.save(
            {
                "state": state,
                "stats": [vars(s) for s in protocol_replica.history],
                "replica": protocol_replica.replica,
                "global_step": trainer.global_step,
                "train_loss": float(trainer.callback_metrics.get("train_loss", float("nan"))),
            },
            os.path.join(args.out, f"replica{protocol_replica.replica}.pt"),
        )


if __name__ == "__main__":
    main()
