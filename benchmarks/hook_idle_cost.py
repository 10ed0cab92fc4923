"""What the lazy-snapshot step hook costs an optimizer step when no snapshot is pending (issue 34 item 2).

Paired: in each round, ``SGD.step()`` of an 8x8 ``Linear`` (the smallest step: any per-step cost shows most) is
timed with the hook absent (no async saver alive) and with the hook registered but disarmed (an async saver alive,
its save complete, one step taken since), in alternating order. Only public API: ``snapshot_guard.hook_state()``
checks each state. Run under the shared lock: ``python benchmarks/hook_idle_cost.py OUT.json``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from lightning_recover.checkpoint import snapshot_guard
from lightning_recover.lightning.checkpoint_io import AsyncUringCheckpointIO


def _per_step_us(opt: torch.optim.Optimizer, steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.step()
    return (time.perf_counter() - t0) / steps * 1e6


def main(out: str, rounds: int = 15, steps: int = 20000) -> dict:
    torch.set_num_threads(1)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    d = tempfile.mkdtemp(prefix="lr-hook-cost-")
    absent, disarmed = [], []
    for r in range(rounds):
        io = AsyncUringCheckpointIO(eager_bytes=0)
        io.save_checkpoint({"w": model.weight}, os.path.join(d, f"r{r}.ckpt"))
        io.wait_until_durable()
        opt.step()  # finds nothing pending: disarms
        assert snapshot_guard.hook_state() == "disarmed"
        order = [("disarmed", io), ("absent", None)] if r % 2 == 0 else [("absent", None), ("disarmed", io)]
        for state, saver in order:
            if state == "absent":
                io.teardown()
                assert snapshot_guard.hook_state() == "absent"
                absent.append(_per_step_us(opt, steps))
            else:
                disarmed.append(_per_step_us(opt, steps))
        io.teardown()
    ratios = [a / b for a, b in zip(disarmed, absent)]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "what": "SGD.step() of Linear(8, 8), microseconds per step, hook disarmed vs absent, paired rounds",
        "command": f"python benchmarks/hook_idle_cost.py {out}",
        "commit": commit,
        "rounds": rounds,
        "steps_per_measurement": steps,
        "absent_us": absent,
        "disarmed_us": disarmed,
        "ratio_disarmed_over_absent": {
            "median": statistics.median(ratios),
            "min": min(ratios),
            "max": max(ratios),
        },
        "extra_us_median": statistics.median(a - b for a, b in zip(disarmed, absent)),
    }
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    r = main(sys.argv[1] if len(sys.argv) > 1 else "hook_idle_cost.json")
    print(json.dumps({k: r[k] for k in ("ratio_disarmed_over_absent", "extra_us_median")}))
