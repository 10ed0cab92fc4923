"""Fabric + ``strategy="recover"``: TinyGPT on the Python standard library's source, 4 replicas on CPU.

    python examples/fabric_gpt.py --steps 20
    # the same, with replica 1 killed in its backward pass of step 5 and replica 2 hung at step 12:
    LIGHTNING_RECOVER_INJECT="kill:replica=1:step=5:phase=backward,hang:replica=2:step=12:phase=reduce" \
        python examples/fabric_gpt.py --steps 20

``fabric.launch()`` turns this process into the tolerant supervisor of 4 replica processes; the
survivors of a failure recompute the lost microbatches inside the same step, so every step still
averages exactly ``--microbatches`` microbatches. The lowest live replica prints the loss.
"""

import argparse


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--microbatches", type=int, default=8, help="M: microbatches per optimizer step")
    parser.add_argument("--batch-size", type=int, default=8, help="samples per microbatch")
    parser.add_argument("--heartbeat-timeout", type=float, default=2.0, help="seconds until a hung replica is dropped")
    args = parser.parse_args()  # before the imports below: --help answers without loading torch (seconds)

    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from lightning_recover import RecoverStrategy
    from lightning_recover.tiny_gpt import ByteCorpus, GPTConfig, TinyGPT, stdlib_text

    torch.manual_seed(0)
    data = ByteCorpus(stdlib_text(1_000_000), block_size=64)
    model = TinyGPT(GPTConfig(block_size=64, n_layer=2, n_embd=128))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    strategy = RecoverStrategy(microbatches=args.microbatches, heartbeat_timeout=args.heartbeat_timeout)
    fabric = L.Fabric(strategy=strategy, devices=args.replicas, accelerator="cpu")
    fabric.launch()  # the parent supervises; each replica process continues below
    model, optimizer = fabric.setup(model, optimizer)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)  # one batch = one microbatch

    for step in fabric.strategy.steps(loader, max_steps=args.steps):
        for x, y in step:  # this replica's quota, then any microbatches lost by a failed replica
            fabric.backward(model.loss(x, y))
        optimizer.step()  # the gradient is the mean over all M microbatches, whoever computed them
        optimizer.zero_grad()
        s = step.stats
        if s.leader:
            print(
                f"step {step.index:3d}  loss {s.loss:.4f}  live replicas {s.live_replicas}"
                + (f"  (recovered: {s.recoveries}x in {s.recovery_seconds:.2f}s)" if s.recoveries else ""),
                flush=True,
            )


if __name__ == "__main__":
    main()
