"""``UringCheckpointIO`` on its own: a plain Lightning ``Trainer`` (no fault tolerance) saving and
resuming through the io_uring checkpoint writer.

    python examples/checkpoint_plugin.py --steps 30 --out ckpt_example
    python examples/checkpoint_plugin.py --steps 60 --out ckpt_example --resume   # continues from step 30
    python examples/checkpoint_plugin.py --steps 60 --out ckpt_example --resume "ckpt_example/epoch=0-step=20.ckpt"

``ModelCheckpoint`` decides *when* to save (here every 10 steps and at the end); the plugin decides
*how*: large aligned O_DIRECT writes, crc32c per extent, an atomic rename at commit. Inspect a
file with ``lightning-recover inspect ckpt_example/last.ckpt``.
"""

import argparse
import glob
import os
import re


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=30, help="train up to this many optimizer steps in all")
    parser.add_argument("--out", default="ckpt_example", help="directory of the checkpoints")
    parser.add_argument(
        "--resume",
        nargs="?",
        const="last",
        default=None,
        metavar="CKPT",
        help="resume from OUT/last.ckpt (which must exist), or from the checkpoint CKPT",
    )
    args = parser.parse_args()  # before the imports below: --help answers without loading torch (seconds)
    last = os.path.join(args.out, "last.ckpt") if args.resume in (None, "last") else args.resume
    if args.resume and not os.path.exists(last):  # never train from scratch when asked to resume
        parser.exit(
            2,
            f"{parser.prog}: --resume: there is nothing to resume: {last} does not exist. HINT: run once without "
            f"--resume (it writes {last}), or give the --out of an earlier run.\n",
        )

    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader

    from lightning_recover.checkpoint.integrity import CheckpointCorruptError
    from lightning_recover.lightning.checkpoint_io import UringCheckpointIO
    from lightning_recover.tiny_gpt import ByteCorpus, GPTConfig, TinyGPT, stdlib_text

    class GPTModule(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = TinyGPT(GPTConfig(block_size=64, n_layer=2, n_embd=128))

        def training_step(self, batch, batch_idx):
            loss = self.model.loss(*batch)
            self.log("loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

    data = ByteCorpus(stdlib_text(500_000), block_size=64)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=args.steps,
        logger=False,
        enable_model_summary=False,
        plugins=[UringCheckpointIO()],
        callbacks=[ModelCheckpoint(dirpath=args.out, every_n_train_steps=10, save_last=True, save_top_k=-1)],
    )
    if args.resume:
        print(f"resuming from {last}", flush=True)
    try:
        trainer.fit(GPTModule(), DataLoader(data, batch_size=8, shuffle=True), ckpt_path=last if args.resume else None)
    except CheckpointCorruptError as exc:  # refused before anything was trained or saved: one line, and a way on
        older = intact_checkpoints(args.out, but=last)
        hint = (
            f"resume from the newest intact checkpoint ModelCheckpoint kept: --resume {older[0]!r}"
            if older
            else f"no other intact checkpoint in {args.out}: train from the start (without --resume)"
        )
        parser.exit(2, f"{parser.prog}: --resume: {exc}. HINT: {hint}\n")
    print(f"trained to step {trainer.global_step}; checkpoints: {sorted(os.listdir(args.out))}")


def intact_checkpoints(directory: str, but: str) -> list[str]:
    """The checkpoints in ``directory`` other than ``but`` whose every record passes its checksum, newest first."""
    from lightning_recover.checkpoint.file.single_file import verify_file
    from lightning_recover.checkpoint.integrity import CheckpointCorruptError

    def newest(path: str) -> tuple[float, int]:  # copies share a time: ModelCheckpoint's names carry the step
        step = re.search(r"step=(\d+)", os.path.basename(path))
        return os.path.getmtime(path), int(step.group(1)) if step else -1

    intact = []
    for path in sorted(glob.glob(os.path.join(directory, "*.ckpt")), key=newest, reverse=True):
        if os.path.samefile(path, but):
            continue
        try:
            if not verify_file(path)[1]:
                intact.append(path)
        except (CheckpointCorruptError, OSError):
            continue
    return intact


if __name__ == "__main__":
    main()
