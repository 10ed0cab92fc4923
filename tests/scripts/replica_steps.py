"""A minimal replica: the protocol's Replica on a tiny linear model, no Lightning (fast to start).

    lightning-recover run --replicas 2 -- python tests/scripts/replica_steps.py STEPS [STEP_SLEEP]

Prints ``STEP s`` after each committed step; STEPS=0 runs until killed.
"""

import sys
import time

import torch

from lightning_recover.protocol.options import RecoverOptions
from lightning_recover.protocol.replica import Replica


def main() -> None:
    steps = int(sys.argv[1])
    pause = float(sys.argv[2]) if len(sys.argv) > 2 else 0.05
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    protocol_replica = Replica.from_env(
        RecoverOptions(microbatches=4, heartbeat_timeout=1.0), lambda: list(model.parameters())
    )
    protocol_replica.start()
    step = 0
    while steps == 0 or step < steps:
        for j in protocol_replica.run_step(step):
            loss = torch.nn.functional.mse_loss(model(x[2 * j : 2 * j + 2]), y[2 * j : 2 * j + 2])
            protocol_replica.before_backward(loss)
            loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.01 * p.grad
        print(f"STEP {step}", flush=True)
        step += 1
        time.sleep(pause)


if __name__ == "__main__":
    main()
