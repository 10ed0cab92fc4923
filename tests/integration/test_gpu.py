"""The NCCL path: survivor groups over NCCL with aborted communicators. Needs >= 2 CUDA GPUs
(NCCL refuses two ranks on one device); skipped cleanly elsewhere (CI has no GPU). Exact mode's CUDA
check needs one GPU."""

import os
import subprocess
import sys

import pytest
import torch

from tests.compare import max_relative_difference
from tests.jobs import ROOT, fabric_job

needs_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2 or not torch.distributed.is_nccl_available(),
    reason="not tested: the NCCL path (survivor groups, aborted communicators), because it needs >= 2 CUDA GPUs with NCCL",
)


@pytest.mark.skipif(
    not torch.cuda.is_available() or not torch.distributed.is_nccl_available(), reason="needs a CUDA GPU with NCCL"
)
@pytest.mark.timeout(180)
def test_exact_mode_is_bitwise_deterministic_on_cuda():
    """tests/scripts/exact_cuda_check.py in a fresh process (cuBLAS reads CUBLAS_WORKSPACE_CONFIG at its
    start): with torch.use_deterministic_algorithms(True), TinyGPT's fixed-point step gradient (float32
    and bf16 parameters) is the same bits over repeats and over partitions of the microbatches; NCCL
    reduces float64 SUM and float32 MAX."""
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8", PYTHONPATH=ROOT)
    script = os.path.join(ROOT, "tests", "scripts", "exact_cuda_check.py")
    proc = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("ok ") == 3, proc.stdout


@needs_two_gpus
def test_nccl_kill_matches_failure_free_run(tmp_path):
    replicas = min(3, torch.cuda.device_count())
    extra = ["--accelerator", "cuda"]
    ref = fabric_job(str(tmp_path / "ref"), replicas=replicas, microbatches=6, extra=extra)
    assert ref.returncode == 0, ref.output[-3000:]
    faulty = fabric_job(
        str(tmp_path / "kill"),
        replicas=replicas,
        microbatches=6,
        extra=extra,
        inject="kill:replica=1:step=1:phase=backward",
    )
    assert faulty.returncode == 0, faulty.output[-3000:]
    reference = ref.states()[0]["state"]
    for data in faulty.states().values():
        assert max_relative_difference({k: v.cpu() for k, v in data["state"].items()}, reference) <= 1e-5


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="not tested: checkpoints of CUDA tensors, because no CUDA GPU"
)
@pytest.mark.parametrize("asynchronous", [False, True])
def test_checkpoint_io_round_trips_cuda_tensors(tmp_path, asynchronous):
    """``UringCheckpointIO`` saves CUDA tensors (float32, bf16, a view, an int tensor) through its host
    staging; the file is a torch.save archive that stock ``torch.load`` reads; the plugin loads it back
    bitwise, onto the device ``map_location`` names."""
    from lightning_recover import AsyncUringCheckpointIO, UringCheckpointIO

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    big = torch.randn(4096, 1024, device=dev, generator=g)
    state = {
        "w": big,
        "half": torch.randn(1000, device=dev, generator=g).to(torch.bfloat16),
        "view": big[7:9, 3:300],
        "step": torch.tensor(12, device=dev),
        "meta": {"epoch": 3},
    }
    io = AsyncUringCheckpointIO() if asynchronous else UringCheckpointIO()
    path = tmp_path / "gpu.ckpt"
    io.save_checkpoint(state, path)
    io.teardown()  # async: waits until the save is durable
    stock = torch.load(path, weights_only=True, map_location="cpu")
    loaded = io.load_checkpoint(path, map_location=lambda storage, loc: storage.cuda())
    for key in ("w", "half", "view", "step"):
        assert torch.equal(stock[key], state[key].cpu()), key
        assert loaded[key].is_cuda and torch.equal(loaded[key], state[key]), key
    assert loaded["meta"] == {"epoch": 3}
