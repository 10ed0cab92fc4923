"""``L.Trainer(strategy=RecoverTrainerStrategy(replica_size=K))``: sharded replicas under the Trainer.

The multi-process runs train the MLP of tests/scripts/sharded_train.py (same data, model and
microbatch layout) with the model built in ``configure_model`` and sharded by the strategy, and
compare the final full parameters with that script's single-process, unsharded float64 reference:
relative difference <= 1e-9 (``check`` of tests/test_sharded.py, which also asserts that no process
of a killed replica is left alive). The fast tests cover what is refused before any process starts.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_recover import RecoverTrainerStrategy
from lightning_recover.lightning.sharded import ShardingConfig
from lightning_recover.lightning.step_logs import StepLogCapture
from tests.jobs import ROOT, run_job
from tests.test_sharded import STEPS, check

SCRIPT = os.path.join(ROOT, "tests", "scripts", "sharded_trainer_train.py")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """sharded_train.py --reference, in this process (no interpreter start-up): {M: state}."""
    spec = importlib.util.spec_from_file_location(
        "sharded_train", os.path.join(ROOT, "tests", "scripts", "sharded_train.py")
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    cache: dict[tuple[int, int], dict] = {}

    def get(microbatches: int, steps: int = STEPS) -> dict:
        if (microbatches, steps) not in cache:
            out = str(tmp_path_factory.mktemp(f"ref{microbatches}_{steps}"))
            args = SimpleNamespace(out=out, steps=steps, microbatches=microbatches, batch_size=4, dtype="float64")
            script.reference(args)
            cache[microbatches, steps] = torch.load(os.path.join(out, "reference.pt"))["state"]
        return cache[microbatches, steps]

    return get


def trainer_job(
    out: str,
    replicas: int,
    microbatches: int,
    parallelize: str,
    inject: str | None = None,
    steps: int = STEPS,
    extra: tuple[str, ...] = (),
):
    cmd = [sys.executable, SCRIPT, out, "--replicas", str(replicas), "--replica-size", "2"]
    cmd += ["--steps", str(steps), "--microbatches", str(microbatches), "--parallelize", parallelize, *extra]
    result = run_job(cmd, out, timeout=400, env={"LIGHTNING_RECOVER_INJECT": inject} if inject else None)
    pids = {os.path.basename(p): int(open(p).read()) for p in glob.glob(os.path.join(out, "pid.*"))}
    return result, pids


def check_logs_and_refusal(states: dict, steps: int = STEPS) -> None:
    for data in states.values():
        assert data["global_step"] == steps
        # self.log("train_loss") in training_step: merged over the K processes of each replica and over
        # the replicas, zero-contribution slots left out, so it is the step's mean loss (logged in float32)
        assert abs(data["train_loss"] - data["stats"][-1]["loss"]) <= 1e-6 * abs(data["stats"][-1]["loss"])
        assert "not yet supported with replica_size>1" in data["save_error"] and "HINT" in data["save_error"]


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_trainer_two_replicas_of_two_failure_free(tmp_path, reference):
    """R=2, K=2, M=8, a parallelize_fn in ModelParallelStrategy style."""
    result, pids = trainer_job(str(tmp_path), replicas=2, microbatches=8, parallelize="fn")
    states = check(result, pids, reference(8), survivors=[0, 1], replicas=2)
    for data in states.values():
        assert all(s["live_replicas"] == 2 and s["recoveries"] == 0 for s in data["stats"])
    check_logs_and_refusal(states)
    assert not os.path.exists(os.path.join(str(tmp_path), "ckpt.ckpt"))


REJOIN_STEPS = 30  # the survivors sleep 1 s after each degraded step, until the restarted replica is back


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_trainer_replica_of_two_is_lost_and_rejoins(tmp_path, reference):
    """R=3, K=2, M=10 (quotas 4, 3, 3: zero-contribution slots), shard='fsdp'; one process of replica 1
    is killed in the backward of step 1: the whole replica leaves, the survivors recompute its
    microbatches in that step, and the replica restarts (restarts=1): each of its two new processes
    restores Lightning's checkpoint from the process at its position in a live replica (its local
    shards). All three replicas end equal to the unsharded reference."""
    inject = "kill:replica=1:inner=1:step=1:phase=backward"
    extra = ("--restarts", "1", "--slow-while-degraded", "1")
    result, pids = trainer_job(str(tmp_path), 3, 10, "fsdp", inject=inject, steps=REJOIN_STEPS, extra=extra)
    states = check(result, pids, reference(10, REJOIN_STEPS), survivors=[0, 1, 2], replicas=3, steps=REJOIN_STEPS)
    assert "restarting replica 1 (1/1)" in result.output
    survivor, rejoined = states[0]["stats"], states[1]["stats"]
    assert survivor[1]["live_replicas"] == 2 and survivor[1]["recoveries"] == 1
    assert survivor[-1]["live_replicas"] == 3, "the quotas include the rejoined replica again"
    assert 1 < rejoined[0]["step"] < REJOIN_STEPS - 1, "it rejoined mid-run"
    check_logs_and_refusal(states, REJOIN_STEPS)


# --------------------------------------------------------------------------- in process, fast


class _Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(strategy: RecoverTrainerStrategy, devices: int = 4, **kwargs) -> None:
    kwargs.setdefault("enable_checkpointing", False)
    trainer = L.Trainer(
        strategy=strategy, devices=devices, accelerator="cpu", logger=False, enable_progress_bar=False, **kwargs
    )
    trainer.fit(_Tiny(), DataLoader(TensorDataset(torch.randn(32, 2)), batch_size=2))


def test_sharded_trainer_refuses_checkpointing_before_starting():
    with pytest.raises(NotImplementedError, match=r"ModelCheckpoint.*replica_size=2.*HINT: pass Trainer\(enable_che"):
        _fit(RecoverTrainerStrategy(microbatches=4, replica_size=2, shard="fsdp"), enable_checkpointing=True)


def test_sharded_trainer_refuses_to_save_or_resume_a_checkpoint(tmp_path):
    strategy = RecoverTrainerStrategy(microbatches=4, replica_size=2, shard="fsdp")
    with pytest.raises(NotImplementedError, match=r"trainer.save_checkpoint is not yet supported.*HINT.*DCP"):
        strategy.save_checkpoint({}, str(tmp_path / "x.ckpt"))
    assert not os.path.exists(tmp_path / "x.ckpt")
    with pytest.raises(NotImplementedError, match=r"resuming from a checkpoint .* replica_size>1.*HINT"):
        strategy.load_checkpoint(str(tmp_path / "x.ckpt"))


def test_sharded_trainer_validates_the_job_shape_before_starting():
    with pytest.raises(ValueError, match="devices=3 is not divisible by replica_size=2"):
        _fit(RecoverTrainerStrategy(microbatches=4, replica_size=2, shard="fsdp"), devices=3)
    with pytest.raises(ValueError, match="microbatches=1 is smaller than replica_size=2"):
        _fit(RecoverTrainerStrategy(microbatches=1, replica_size=2, shard="fsdp"), devices=2)
    with pytest.raises(ValueError, match="replica_size=2 needs a way to shard the model"):
        RecoverTrainerStrategy(replica_size=2)


def test_sharded_trainer_strategy_ranks():
    strategy = RecoverTrainerStrategy(microbatches=4, replica_size=2, parallelize_fn=lambda m, mesh: m)
    strategy.core = SimpleNamespace(rank=1, size=2, inner=1)
    assert (strategy.global_rank, strategy.world_size, strategy.is_global_zero) == (3, 4, False)
    strategy.core = SimpleNamespace(rank=0, size=2, inner=1)
    assert not strategy.is_global_zero  # only process 0 of the lowest live replica logs and prints


def test_prepare_backward_scales_zeroes_and_sets_gradient_sync():
    calls = []

    class Sharded(torch.nn.Module):
        def set_requires_gradient_sync(self, sync, recurse=True):
            calls.append((sync, recurse))

    module = torch.nn.Sequential(Sharded(), torch.nn.Linear(1, 1), Sharded())
    sharding = ShardingConfig(replica_size=2, shard="fsdp")
    loss = torch.tensor(3.0)
    core = SimpleNamespace(zero_slot=False, sync_round=False)
    assert sharding.prepare_backward(core, loss, [module]).item() == 6.0  # FSDP2 averages over K: times K
    assert calls == [(False, False), (False, False)]
    core = SimpleNamespace(zero_slot=True, sync_round=True)
    assert sharding.prepare_backward(core, loss, [module]).item() == 0.0
    assert calls[-2:] == [(True, False), (True, False)]
    unsharded = ShardingConfig()
    assert unsharded.prepare_backward(SimpleNamespace(zero_slot=False), loss, [module]) is loss


class _Logs:
    def log(self, name, value, reduce_fx="mean"):
        raise AssertionError("captured values are logged once per step, by log_step")


def test_zero_contribution_slots_are_not_logged():
    module = _Logs()
    with StepLogCapture(module) as capture:
        module.log("loss", 1.0)
        capture.skip = True
        module.log("loss", 100.0)
        capture.skip = False
        module.log("loss", 3.0)
    assert capture.values["loss"] == [4.0, 2.0, 3.0, 1.0]
