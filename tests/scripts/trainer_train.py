"""Training script used by tests/integration/test_trainer_strategy.py: a small regression MLP under the Trainer.

    python tests/scripts/trainer_train.py OUT_DIR --replicas 3 --steps 6 --microbatches 6

Every replica that finishes writes OUT_DIR/replica{r}.pt (final parameters and per-step stats);
logs go to OUT_DIR/logs/version_0/metrics.csv, checkpoints to OUT_DIR/ckpt/step=S.ckpt.
"""

import argparse
import os
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

import lightning_recover  # noqa: F401  (registers strategy="recover")
from lightning_recover import RecoverTrainerStrategy

IN, HIDDEN = 16, 32


def make_data():
    """Training and validation sets (the same in every process)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, IN, generator=gen)
    w = torch.randn(IN, 1, generator=gen)
    y = (x @ w).tanh() + 0.01 * torch.randn(512, 1, generator=gen)
    xv = torch.randn(40, IN, generator=gen)
    yv = (xv @ w).tanh()
    return TensorDataset(x, y), TensorDataset(xv, yv)


def make_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 1))


class StepRecorder(L.Callback):
    """Records (global step, epoch, StepBatch position) of every step this replica runs."""

    def __init__(self) -> None:
        self.steps: list[dict] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.steps.append(
            {
                "step": trainer.global_step,
                "epoch": trainer.current_epoch,
                "position": batch.position,
                "batch_idx": batch_idx,
            }
        )


class Hold(L.Callback):
    """``--hold STEP:PATH,...``: before optimizer step STEP (``trainer.global_step == STEP`` as its batch starts),
    wait until PATH exists, so that a test can let the replicas go on only once an event it waits for happened."""

    def __init__(self, spec: str) -> None:
        self.gates = {int(step): path for step, _, path in (item.partition(":") for item in spec.split(",") if item)}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        gate = self.gates.get(trainer.global_step)
        deadline = time.monotonic() + 600  # a newcomer's start under a loaded host's imports can take minutes
        while gate and not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.05)


class Regressor(L.LightningModule):
    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = make_net()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch  # ONE microbatch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        self.log("train_loss_max", loss, reduce_fx="max")
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y), sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", torch.nn.functional.mse_loss(self(x), y), sync_dist=True)
        self.log("test_samples", float(len(x)), reduce_fx="sum", sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--microbatches", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--heartbeat-timeout", type=float, default=1.0)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--ckpt-every", type=int, default=0, help="ModelCheckpoint every N steps (0: none)")
    parser.add_argument("--val-every", type=int, default=0, help="validate every N steps (0: no validation)")
    parser.add_argument("--resume", default=None, help='ckpt_path to resume from ("hpc": Lightning\'s HPC checkpoint)')
    parser.add_argument("--root-dir", default=None, help="the Trainer's default_root_dir (default: OUT_DIR)")
    parser.add_argument("--notice-checkpoint", default=None, help="RecoverTrainerStrategy(notice_checkpoint=...)")
    parser.add_argument("--progress-bar", action="store_true")
    parser.add_argument("--clip", type=float, default=None)
    parser.add_argument("--test", action="store_true", help="trainer.test() on the validation set after fit")
    parser.add_argument("--quota", default="equal")
    parser.add_argument("--restarts", type=int, default=0, help="RecoverTrainerStrategy(restarts=K)")
    parser.add_argument("--exact", action="store_true", help="RecoverTrainerStrategy(exact=True)")
    parser.add_argument(
        "--hold",
        default="",
        help="STEP:PATH,...: before optimizer step STEP (global_step == STEP), wait until PATH exists (at most "
        "600 s); lets a test hold the replicas until a restarted one asked to join",
    )
    args = parser.parse_args()

    os.makedirs(args.out, exist_ok=True)
    train, val = make_data()
    train_loader = DataLoader(train, batch_size=args.batch_size, shuffle=True)
    val_loader = DataLoader(val, batch_size=8) if args.val_every else None
    strategy = RecoverTrainerStrategy(
        microbatches=args.microbatches,
        heartbeat_timeout=args.heartbeat_timeout,
        heartbeat_interval=min(0.1, args.heartbeat_timeout / 5),
        restarts=args.restarts,
        quota=args.quota,
        exact=args.exact,
        notice_checkpoint=args.notice_checkpoint,
    )
    recorder = StepRecorder()
    callbacks = [recorder, Hold(args.hold)]
    if args.ckpt_every:
        callbacks.append(
            ModelCheckpoint(
                dirpath=os.path.join(args.out, "ckpt"),
                filename="{step}",
                every_n_train_steps=args.ckpt_every,
                save_top_k=-1,
            )
        )
    trainer = L.Trainer(
        strategy=strategy,
        devices=args.replicas,
        accelerator="cpu",
        precision=args.precision,
        max_steps=args.steps,
        default_root_dir=args.root_dir or args.out,
        logger=CSVLogger(args.out, name="logs"),
        log_every_n_steps=1,
        enable_progress_bar=args.progress_bar,
        enable_model_summary=False,
        callbacks=callbacks,
        enable_checkpointing=bool(args.ckpt_every),
        val_check_interval=args.val_every or None,
        limit_val_batches=None if args.val_every else 0,
        num_sanity_val_steps=0,
        gradient_clip_val=args.clip,
    )
    model = Regressor()
    trainer.fit(model, train_loader, val_loader, ckpt_path=args.resume)
    # Only replicas reach this line (the launcher process exits inside fit with the job's status).
    test_metrics = trainer.test(model, DataLoader(val, batch_size=8), verbose=False)[0] if args.test else {}
    protocol_replica = trainer.strategy.protocol_replica
    state = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    torch.save(
        {
            "state": state,
            "stats": [vars(s) for s in protocol_replica.history],
            "replica": trainer.strategy.replica,
            "global_step": trainer.global_step,
            "steps": recorder.steps,
            "batches_that_stepped": trainer.fit_loop.epoch_loop._batches_that_stepped,
            "current_epoch": trainer.current_epoch,
            "callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
            "test_metrics": {k: float(v) for k, v in test_metrics.items()},
        },
        os.path.join(args.out, f"replica{trainer.strategy.replica}.pt"),
    )


if __name__ == "__main__":
    main()
