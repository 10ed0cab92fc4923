"""Exact mode on CUDA (tests/integration/test_gpu.py runs this in a fresh process; needs one GPU, < 2 minutes).

    CUBLAS_WORKSPACE_CONFIG=:4096:8 python tests/scripts/exact_cuda_check.py

With ``torch.use_deterministic_algorithms(True)``, TinyGPT's microbatch gradients on the GPU are the
same bits every time they are computed, so exact mode's fixed-point sum is the same bits whichever
"replica" (accumulator) computed which microbatch and in which order; and NCCL reduces the two
collectives exact mode issues (SUM of float64, MAX of float32) in a one-rank group. Prints one
line per check and exits non-zero on the first failure.
"""

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist

from lightning_recover.protocol.exact import ExactAccumulator, exact_step_alone
from lightning_recover.tiny_gpt import build

M = 8


def gradients_by_partition(model, batches, order, parts):
    """Each part of the ids absorbed by its own accumulator (as replicas do), their sums added in ``order``."""
    params = list(model.parameters())
    reference = ExactAccumulator(M)
    # the grid: from a single-process step (its calibration attempt), shared by every "replica"
    exact_step_alone(reference, params, lambda j: _backward(model, batches[j]))
    model.zero_grad(set_to_none=True)  # the step's result: not part of the partitions' sums
    sums = []
    for part in parts:
        acc = ExactAccumulator(M)
        acc.load_state(reference.state())
        acc.begin(params)
        for j in part:
            _backward(model, batches[j])
            acc.absorb(params)
        sums.append(acc.acc)
    total = torch.zeros_like(sums[0])
    for i in order:
        total += sums[i]
    return total


def _backward(model, batch):
    loss = model.loss(*batch)
    loss.backward()
    return loss


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda", help="cpu: the same checks without the GPU (and without NCCL)")
    args = p.parse_args()
    torch.use_deterministic_algorithms(True)
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    ns = argparse.Namespace(seed=0, corpus_bytes=200_000, block_size=64, layers=2, width=128, lr=3e-3)
    for dtype in (torch.float32, torch.bfloat16):
        data, model, _ = build(ns)
        model.to(device=device, dtype=dtype)
        gen = torch.Generator().manual_seed(1)
        idx = torch.randint(0, len(data), (M * 8,), generator=gen)
        batches = []
        for j in range(M):
            xs, ys = zip(*(data[int(i)] for i in idx[j * 8 : (j + 1) * 8]))
            batches.append((torch.stack(xs).to(device), torch.stack(ys).to(device)))
        one = gradients_by_partition(model, batches, [0], [list(range(M))])
        again = gradients_by_partition(model, batches, [0], [list(range(M))])
        assert torch.equal(one, again), f"{dtype}: the same microbatches gave different gradient bits on CUDA"
        split = gradients_by_partition(model, batches, [2, 0, 1], [[7, 0, 3], [5, 1], [2, 6, 4]])
        assert torch.equal(split, one), f"{dtype}: a partition over 3 accumulators changed the sum's bits"
        print(f"ok {dtype}: bitwise equal across repeats and partitions ({one.numel()} elements)", flush=True)

    if device.type != "cuda":
        sys.exit(0)
    # NCCL: the two collectives of exact mode, in a one-rank group
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1)
        try:
            sums = torch.arange(10, dtype=torch.float64, device=device) * 2.0**40
            dist.all_reduce(sums)
            peak = torch.tensor([1.5, -2.0], device=device)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            torch.cuda.synchronize()
            assert torch.equal(sums.cpu(), torch.arange(10, dtype=torch.float64) * 2.0**40)
            assert torch.equal(peak.cpu(), torch.tensor([1.5, -2.0]))
            print("ok nccl: float64 SUM and float32 MAX", flush=True)
        finally:
            dist.destroy_process_group()
    sys.exit(0)


if __name__ == "__main__":
    main()
