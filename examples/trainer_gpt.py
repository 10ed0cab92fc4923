"""``Trainer(strategy="recover")``: TinyGPT on the Python standard library's source, 4 replicas on CPU.

    python examples/trainer_gpt.py --steps 20
    # with a replica killed at step 5 (the others recompute its microbatches inside the step):
    LIGHTNING_RECOVER_INJECT="kill:replica=1:step=5:phase=backward" python examples/trainer_gpt.py --steps 20

``training_step`` receives ONE microbatch; an optimizer step covers ``--microbatches`` of them,
whichever replicas are alive. ``trainer.fit`` turns this process into the tolerant supervisor of
the replica processes; the progress bar is Lightning's own.
"""

import argparse


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--replicas", type=int, default=4, help="data-parallel replicas (processes)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--microbatches", type=int, default=8, help="M: microbatches per optimizer step")
    parser.add_argument("--heartbeat-timeout", type=float, default=2.0, help="seconds until a hung replica is dropped")
    args = parser.parse_args()  # before the imports below: --help answers without loading torch (seconds)

    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from lightning_recover import RecoverTrainerStrategy
    from lightning_recover.tiny_gpt import ByteCorpus, GPTConfig, TinyGPT, stdlib_text

    class GPTModule(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = TinyGPT(GPTConfig(block_size=64, n_layer=2, n_embd=128))

        def training_step(self, batch, batch_idx):
            loss = self.model.loss(*batch)  # one microbatch
            self.log("loss", loss, prog_bar=True, sync_dist=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

    data = ByteCorpus(stdlib_text(1_000_000), block_size=64)
    trainer = L.Trainer(
        strategy=RecoverTrainerStrategy(microbatches=args.microbatches, heartbeat_timeout=args.heartbeat_timeout),
        devices=args.replicas,
        accelerator="cpu",
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(GPTModule(), DataLoader(data, batch_size=8, shuffle=True))


if __name__ == "__main__":
    main()
