"""``L.Trainer(strategy=RecoverTrainerStrategy(replica_size=K))``: sharded replicas under the Trainer.

The multi-process runs train the MLP of tests/scripts/sharded_train.py (same data, model and
microbatch layout) with the model built in ``configure_model`` and sharded by the strategy, and
compare the final full parameters with that script's single-process, unsharded float64 reference:
relative difference <= 1e-9 (``check`` of tests/integration/test_sharded.py, which also asserts that no process
of a killed replica is left alive); the failure-free job also saves sharded checkpoints and a second
job resumes from one. The fast tests cover what is refused and the checkpoint state conversion.
"""

from __future__ import annotations

import glob
import os
import sys
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_recover import RecoverTrainerStrategy, env
from lightning_recover.lightning.sharding_config import ShardingConfig
from lightning_recover.lightning.step_logs import StepLogCapture
from tests.integration import test_sharded
from tests.integration.test_sharded import STEPS, check
from tests.jobs import ROOT, join_request, run_gated_job, run_job

SCRIPT = os.path.join(ROOT, "tests", "scripts", "sharded_trainer_train.py")
reference = test_sharded.reference  # the same failure-free reference fixture


def trainer_job(
    out: str,
    replicas: int,
    microbatches: int,
    parallelize: str,
    inject: str | None = None,
    steps: int = STEPS,
    extra: tuple[str, ...] = (),
    gate: tuple[str, int] | None = None,
):
    """``gate`` = (PATH, r): the job's ``--hold`` file, created once replica r asked to join."""
    cmd = [sys.executable, SCRIPT, out, "--replicas", str(replicas), "--replica-size", "2"]
    cmd += ["--steps", str(steps), "--microbatches", str(microbatches), "--parallelize", parallelize, *extra]
    env = {"LIGHTNING_RECOVER_INJECT": inject} if inject else None
    if gate is None:
        result = run_job(cmd, out, timeout=400, env=env)
    else:
        path, joiner = gate
        result = run_gated_job(cmd, out, path, lambda log: join_request(joiner) in log, timeout=400, env=env)
    pids = {os.path.basename(p): int(open(p).read()) for p in glob.glob(os.path.join(out, "pid.*"))}
    return result, pids


def check_logs(states: dict, steps: int = STEPS) -> None:
    for data in states.values():
        assert data["global_step"] == steps
        # self.log("train_loss") in training_step: merged over the K processes of each replica and over
        # the replicas, zero-contribution slots left out, so it is the step's mean loss (logged in float32)
        assert abs(data["train_loss"] - data["stats"][-1]["loss"]) <= 1e-6 * abs(data["stats"][-1]["loss"])


SAVE_AT = 2


@pytest.mark.slow
@pytest.mark.timeout(700)
def test_trainer_two_replicas_of_two_failure_free(tmp_path, reference):
    """R=2, K=2, M=8, a parallelize_fn in ModelParallelStrategy style; sharded checkpoints.

    Job 1 trains 4 steps with two ModelCheckpoints every 2 steps: OUT/keep keeps every one, OUT/latest
    (save_top_k=1, save_last=True) removes step 2's directory at step 4 and overwrites last.ckpt. Each
    checkpoint is one DCP directory written by both replicas (2 processes each: 4 shard files); step
    2's verifies (CRC-32C) and loads with stock dcp.load + FileSystemReader into this process (no
    process group): the parameters of the reference at step 2. Job 2, a fresh 2 x 2 job, resumes with
    fit(ckpt_path=step 2's directory) and trains steps 2..3: module, AdamW state and loops restored, it
    ends equal to the uninterrupted reference (relative difference <= 1e-9)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from lightning_recover.checkpoint import verify_dcp_checkpoint
    from lightning_recover.lightning.trainer_checkpoint import trainer_checkpoint_metadata
    from tests.compare import max_relative_difference

    out = str(tmp_path / "run1")
    result, pids = trainer_job(out, replicas=2, microbatches=8, parallelize="fn", extra=("--ckpt-every", str(SAVE_AT)))
    states = check(result, pids, reference(8), survivors=[0, 1], replicas=2)
    for data in states.values():
        assert all(s["live_replicas"] == 2 and s["recoveries"] == 0 for s in data["stats"])
    check_logs(states)

    keep, latest = os.path.join(out, "keep"), os.path.join(out, "latest")
    assert sorted(os.listdir(keep)) == ["step=2.ckpt", "step=4.ckpt"]
    assert sorted(os.listdir(latest)) == ["last.ckpt", "step=4.ckpt"], "step 2's directory removed, no temp left"
    ckpt = os.path.join(keep, "step=2.ckpt")
    info = verify_dcp_checkpoint(ckpt)
    assert info["verified"] and info["files"] == 4
    assert trainer_checkpoint_metadata(ckpt)["global_step"] == SAVE_AT
    assert trainer_checkpoint_metadata(os.path.join(latest, "last.ckpt"))["global_step"] == STEPS
    at_save = reference(8, steps=SAVE_AT)
    assert not dist.is_initialized()
    full = {"state_dict": {f"net.{k}": torch.empty_like(v) for k, v in at_save.items()}}
    dcp.load(full, storage_reader=FileSystemReader(ckpt))
    assert max_relative_difference({k.removeprefix("net."): v for k, v in full["state_dict"].items()}, at_save) <= 1e-9

    out2 = str(tmp_path / "run2")
    result, pids = trainer_job(out2, replicas=2, microbatches=8, parallelize="fn", extra=("--resume", ckpt))
    states = check(result, pids, reference(8), survivors=[0, 1], replicas=2)
    for data in states.values():
        assert [s["step"] for s in data["stats"]] == list(range(SAVE_AT, STEPS))
    check_logs(states)


REJOIN_STEPS = 6


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_trainer_replica_of_two_is_lost_and_rejoins(tmp_path, reference):
    """R=3, K=2, M=10 (quotas 4, 3, 3: zero-contribution slots), shard='fsdp'; one process of replica 1
    is killed in the backward of step 1: the whole replica leaves, the survivors recompute its
    microbatches in that step, and the replica restarts (restarts=1): each of its two new processes
    restores Lightning's checkpoint from the process at its position in a live replica (its local
    shards). All three replicas end equal to the unsharded reference."""
    inject = "kill:replica=1:inner=1:step=1:phase=backward"
    gate = str(tmp_path / "gate")
    # the survivors wait before step 2 until the restarted replica asked to join: step 2's commit admits it
    extra = ("--restarts", "1", "--hold", f"2:{gate}")
    out = str(tmp_path / "job")
    result, pids = trainer_job(out, 3, 10, "fsdp", inject=inject, steps=REJOIN_STEPS, extra=extra, gate=(gate, 1))
    states = check(result, pids, reference(10, steps=REJOIN_STEPS), survivors=[0, 1, 2], replicas=3, steps=REJOIN_STEPS)
    assert "restarting replica 1 (1/1)" in result.output
    survivor, rejoined = states[0]["stats"], states[1]["stats"]
    assert survivor[1]["live_replicas"] == 2 and survivor[1]["recoveries"] == 1
    assert survivor[-1]["live_replicas"] == 3, "the quotas include the rejoined replica again"
    assert 1 < rejoined[0]["step"] < REJOIN_STEPS - 1, "it rejoined mid-run"
    check_logs(states, REJOIN_STEPS)


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


def test_sharded_trainer_refuses_what_a_sharded_checkpoint_cannot_be(tmp_path):
    strategy = RecoverTrainerStrategy(microbatches=4, replica_size=2, shard="fsdp")
    with pytest.raises(  # Lightning's wording for a strategy that does not use the CheckpointIO
        TypeError,
        match=r"`RecoverTrainerStrategy.save_checkpoint\(..., storage_options=...\)` is not supported because",
    ):
        strategy.save_checkpoint({}, str(tmp_path / "x.ckpt"), storage_options={"a": 1})
    single = tmp_path / "single.ckpt"
    torch.save({"state_dict": {}}, single)
    strategy.model = _Tiny()
    with pytest.raises(ValueError, match="single file.*HINT"):
        strategy.load_checkpoint(str(single))
    with pytest.raises(FileNotFoundError, match="no sharded checkpoint"):
        strategy.load_checkpoint(str(tmp_path / "missing.ckpt"))
    with pytest.raises(ValueError, match="weights_only loader"):
        strategy.load_checkpoint(str(tmp_path / "x.ckpt"), weights_only=False)


class _Opaque:  # a hyper-parameter the weights-only loader refuses
    pass


def _tiny_trained(seed: int):
    torch.manual_seed(seed)
    module = _Tiny().double()
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    module.layer(torch.randn(3, 2, dtype=torch.float64)).sum().backward()
    optimizer.step()
    return module, optimizer


def test_trainer_checkpoint_state_round_trip(tmp_path):
    """Lightning's checkpoint dict -> DCP state (module, optimizer, one bytes item per other entry) ->
    back, in one process: empty dicts, tuples and tensors survive, everything is read weights-only,
    a hyper-parameter of another type is skipped, and stock dcp.load reads the module."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from lightning_recover.checkpoint import UnsafeCheckpointError, verify_dcp_checkpoint
    from lightning_recover.checkpoint.dcp.sharded_state import save_sharded
    from lightning_recover.lightning.trainer_checkpoint import (
        dcp_state,
        load_trainer_checkpoint,
        trainer_checkpoint_metadata,
    )

    module, optimizer = _tiny_trained(0)
    meta = {
        "epoch": 0,
        "global_step": 2,
        "loops": {"fit_loop": {"state_dict": {}, "epoch_loop.batch_progress": {"total": {"ready": 2}}}},
        "callbacks": {"ModelCheckpoint{'monitor': None}": {"best_model_score": torch.tensor(0.5), "kth": (1, "a")}},
        "lr_schedulers": [],
        "hyper_parameters": {"thing": _Opaque()},
        "mine": [1, 2.5, None],
    }
    checkpoint = {**meta, "state_dict": module.state_dict(), "optimizer_states": [optimizer.state_dict()]}
    path = str(tmp_path / "epoch=0-step=2.ckpt")
    save_sharded(path, dcp_state(checkpoint, module, [optimizer]))
    assert verify_dcp_checkpoint(path)["verified"]
    module2, optimizer2 = _tiny_trained(1)
    restored = load_trainer_checkpoint(path, module2, [optimizer2])
    del meta["hyper_parameters"]  # not loadable weights-only, not needed to resume: skipped
    assert sorted(restored) == sorted(meta) and restored["loops"] == meta["loops"] and restored["mine"] == meta["mine"]
    callback = restored["callbacks"]["ModelCheckpoint{'monitor': None}"]
    assert callback["kth"] == (1, "a") and torch.equal(callback["best_model_score"], torch.tensor(0.5))
    assert all(torch.equal(a, b) for a, b in zip(module.state_dict().values(), module2.state_dict().values()))
    for p, p2 in zip(module.parameters(), module2.parameters()):
        assert torch.equal(optimizer.state[p]["exp_avg_sq"], optimizer2.state[p2]["exp_avg_sq"])
    assert trainer_checkpoint_metadata(path)["global_step"] == 2
    stock = {"state_dict": {k: torch.empty_like(v) for k, v in module.state_dict().items()}}
    dcp.load(stock, storage_reader=FileSystemReader(path))
    assert torch.equal(stock["state_dict"]["layer.weight"], module.layer.weight)

    # weights only (save_weights_only=True): no optimizer entry, so fitting from it is refused
    weights = str(tmp_path / "weights.ckpt")
    save_sharded(weights, dcp_state({**meta, "state_dict": module.state_dict()}, module, [optimizer]))
    with pytest.raises(KeyError, match="optimizer_0"):
        load_trainer_checkpoint(weights, module2, [optimizer2])
    assert load_trainer_checkpoint(weights, module2, [])["global_step"] == 2  # validate/test: the module only

    # anything else that is not weights-only loadable is refused, never unpickled
    evil = str(tmp_path / "evil.ckpt")
    save_sharded(evil, dcp_state({**meta, "mine": _Opaque(), "state_dict": {}}, module, []))
    with pytest.raises(UnsafeCheckpointError, match="'mine'.*weights_only.*HINT"):
        load_trainer_checkpoint(evil, module2, [])
    # a fabric.save checkpoint is not a Trainer checkpoint
    fabric_style = str(tmp_path / "fabric")
    save_sharded(fabric_style, {"model": module, "step": 2})
    with pytest.raises(ValueError, match="not a Trainer checkpoint.*HINT"):
        load_trainer_checkpoint(fabric_style, module2, [])


def test_sharded_trainer_validates_the_job_shape_before_starting():
    with pytest.raises(ValueError, match="devices=3 is not divisible by replica_size=2"):
        _fit(RecoverTrainerStrategy(microbatches=4, replica_size=2, shard="fsdp"), devices=3)
    with pytest.raises(ValueError, match="microbatches=1 is smaller than replica_size=2"):
        _fit(RecoverTrainerStrategy(microbatches=1, replica_size=2, shard="fsdp"), devices=2)
    with pytest.raises(ValueError, match="replica_size=2 needs a way to shard the model"):
        RecoverTrainerStrategy(replica_size=2)


def test_sharded_trainer_strategy_ranks():
    strategy = RecoverTrainerStrategy(microbatches=4, replica_size=2, parallelize_fn=lambda m, mesh: m)
    strategy.protocol_replica = SimpleNamespace(rank=1, size=2, inner=1, joined=True)
    assert (strategy.global_rank, strategy.world_size, strategy.is_global_zero) == (3, 4, False)
    strategy.protocol_replica = SimpleNamespace(rank=0, size=2, inner=1, joined=True)
    assert not strategy.is_global_zero  # only process 0 of the lowest live replica logs and prints


def test_fabric_and_trainer_strategies_number_processes_alike(monkeypatch):
    """Issue 34 item 1: with K processes per replica, Fabric's strategy answers Lightning's one-rank-per-process
    numbering exactly as the Trainer's: global_rank = live rank x K + inner, world_size = live replicas x K,
    local_rank = global_rank, node_rank = 0, one is_global_zero process. The live rank (and so these) is renumbered
    when replicas fail; the replica id is what stays (``strategy.replica``)."""
    from lightning_recover import RecoverStrategy

    def ranks(strategy):
        return (
            strategy.global_rank,
            strategy.local_rank,
            strategy.node_rank,
            strategy.world_size,
            strategy.is_global_zero,
        )

    kw = {"microbatches": 4, "replica_size": 2, "parallelize_fn": lambda m, mesh: m}
    fabric_strategy, trainer_strategy = RecoverStrategy(**kw), RecoverTrainerStrategy(**kw)
    seen = []
    for live_rank, inner in [(0, 0), (0, 1), (1, 0), (1, 1)]:  # R = 2 live replicas x K = 2
        for strategy in (fabric_strategy, trainer_strategy):
            strategy.protocol_replica = SimpleNamespace(
                rank=live_rank, size=2, inner=inner, replica=live_rank + 5, joined=True
            )
        assert ranks(fabric_strategy) == ranks(trainer_strategy)
        seen.append(ranks(fabric_strategy))
    assert seen == [(0, 0, 0, 4, True), (1, 1, 0, 4, False), (2, 2, 0, 4, False), (3, 3, 0, 4, False)]
    # replica 6 (live rank 1) loses its peer with the lower id: renumbered to rank 0; its replica id stays
    fabric_strategy.protocol_replica = SimpleNamespace(rank=0, size=1, inner=1, replica=6, joined=True)
    assert ranks(fabric_strategy) == (1, 1, 0, 2, False) and fabric_strategy.replica == 6
    # a restarted replica before it rejoins belongs to no generation: its replica id stands in for the live
    # rank, the world is the job's, and it is never is_global_zero (replica 0's process 0 included)
    monkeypatch.setenv(env.REPLICAS, "2")  # the launcher sets it in every replica process
    for strategy in (fabric_strategy, trainer_strategy):
        strategy.protocol_replica = SimpleNamespace(inner=0, replica=0, joined=False)
    assert ranks(fabric_strategy) == ranks(trainer_strategy) == (0, 0, 0, 4, False)


def test_prepare_backward_scales_zeroes_and_sets_gradient_sync():
    calls = []

    class Sharded(torch.nn.Module):
        def set_requires_gradient_sync(self, sync, recurse=True):
            calls.append((sync, recurse))

    module = torch.nn.Sequential(Sharded(), torch.nn.Linear(1, 1), Sharded())
    sharding = ShardingConfig(replica_size=2, shard="fsdp")
    loss = torch.tensor(3.0)
    protocol_replica = SimpleNamespace(zero_slot=False, sync_round=False)
    assert sharding.prepare_backward(protocol_replica, loss, [module]).item() == 6.0  # FSDP2 averages over K: times K
    assert calls == [(False, False), (False, False)]
    protocol_replica = SimpleNamespace(zero_slot=True, sync_round=True)
    assert sharding.prepare_backward(protocol_replica, loss, [module]).item() == 0.0
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
