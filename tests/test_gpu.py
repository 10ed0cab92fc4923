"""The NCCL path: survivor groups over NCCL with aborted communicators. Needs >= 2 CUDA GPUs
(NCCL refuses two ranks on one device); skipped cleanly elsewhere (CI has no GPU)."""

import pytest
import torch

from tests.jobs import fabric_job, max_relative_difference

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2 or not torch.distributed.is_nccl_available(),
    reason="not tested: the NCCL path (survivor groups, aborted communicators), because it needs >= 2 CUDA GPUs with NCCL",
)


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
