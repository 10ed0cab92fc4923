"""``L.Trainer(strategy="recover")`` end to end: real replica processes, real faults, checkpoints.

Every run is compared with a single-process computation of the same training (plain PyTorch over
the same microbatches): final parameters (max relative difference <= 1e-5), the loss logged per
step (the mean over the step's M microbatches) and the validation loss.
"""

from __future__ import annotations

import csv
import importlib.util
import math
import os
import sys
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import lightning_recover
from lightning_recover import RecoverTrainerStrategy
from lightning_recover.data import MicrobatchSource
from lightning_recover.lightning.trainer import StepLoader
from lightning_recover.protocol.exact import ExactAccumulator, exact_step_alone
from tests.compare import max_relative_difference
from tests.jobs import TRAINER_SCRIPT, join_request, run_gated_job, trainer_job

TOL = 1e-5
REPLICAS, STEPS, M, B = 3, 6, 6, 4


def _script():
    spec = importlib.util.spec_from_file_location("trainer_train", TRAINER_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _single_process(steps: int = STEPS, microbatches: int = M, batch_size: int = B, exact: bool = False) -> dict:
    """The same training without Lightning or replicas: the ground truth. ``exact``: each step as
    ``RecoverTrainerStrategy(exact=True)`` computes it (fixed point, protocol/exact.py), which every
    replica of an exact-mode run must equal bitwise."""
    script = _script()
    train, val = script.make_data()
    net = script.make_net()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    source = MicrobatchSource(train, batch_size, microbatches, shuffle=True, seed=0)
    accumulator = ExactAccumulator(microbatches) if exact else None
    losses, val_losses = [], []
    for step in range(steps):
        optimizer.zero_grad()
        total = 0.0

        def backward(j: int, step: int = step) -> torch.Tensor:
            x, y = source.batch(step, j)
            loss = torch.nn.functional.mse_loss(net(x), y)
            loss.backward()
            return loss

        if accumulator is not None:
            total = exact_step_alone(accumulator, list(net.parameters()), backward) * microbatches
        for j in range(microbatches if accumulator is None else 0):
            x, y = source.batch(step, j)
            loss = torch.nn.functional.mse_loss(net(x), y)
            (loss / microbatches).backward()
            total += loss.item()
        losses.append(total / microbatches)
        optimizer.step()
        with torch.no_grad():
            val_losses.append(torch.nn.functional.mse_loss(net(val.tensors[0]), val.tensors[1]).item())
    return {
        "state": {f"net.{k}": v.detach().clone() for k, v in net.state_dict().items()},
        "losses": losses,
        "val_losses": val_losses,
    }


@pytest.fixture(scope="module")
def truth():
    return _single_process()


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """A failure-free 3-replica run with validation, checkpoints every 3 steps and the progress bar on."""
    out = str(tmp_path_factory.mktemp("trainer_ref"))
    result = trainer_job(out, extra=["--ckpt-every", "3", "--val-every", "3", "--progress-bar", "--test"])
    assert result.returncode == 0, result.output[-4000:]
    return result


def metrics(out: str) -> list[dict]:
    with open(os.path.join(out, "logs", "version_0", "metrics.csv")) as f:
        return list(csv.DictReader(f))


def step_rows(out: str) -> dict[int, dict]:
    return {int(r["step"]): r for r in metrics(out) if r.get("recover/loss")}


def assert_parameters(result, reference_state, survivors, steps: int = STEPS, exact: bool = False):
    """Every survivor ran all steps and equals the single-process run: bitwise in exact mode, else within TOL."""
    states = result.states()
    assert sorted(states) == sorted(survivors), f"finished replicas {sorted(states)}\n{result.output[-3000:]}"
    for r, data in states.items():
        diff = max_relative_difference(data["state"], reference_state)
        assert diff <= TOL, f"replica {r} differs from the single-process run: max relative difference {diff}"
        if exact:
            differ = [k for k, v in reference_state.items() if not torch.equal(data["state"][k], v)]
            assert not differ, f"replica {r}: {differ} not bitwise equal to the exact single-process run ({diff})"
        assert data["global_step"] == steps
    return states


def close(a: float, b: float, tol: float = TOL) -> bool:
    return abs(a - b) <= tol * max(abs(b), 1e-12)


# --------------------------------------------------------------------------- multi-process runs


@pytest.mark.slow
def test_failure_free_run_matches_single_process_training(reference_run, truth):
    out = reference_run.out_dir
    assert_parameters(reference_run, truth["state"], survivors=range(REPLICAS))
    rows = step_rows(out)
    assert sorted(rows) == list(range(STEPS))
    for step, row in rows.items():
        # the loss logged per step is the mean over its M microbatches (all replicas together)
        assert close(float(row["recover/loss"]), truth["losses"][step]), (step, row)
        assert close(float(row["train_loss"]), truth["losses"][step]), (step, row)  # self.log in training_step
        assert float(row["train_loss_max"]) >= float(row["train_loss"])
        assert float(row["recover/live_replicas"]) == REPLICAS
        assert float(row["recover/recoveries"]) == 0 and float(row["recover/recomputed_microbatches"]) == 0
        assert float(row["recover/generation"]) == 0
    val = {int(r["step"]): float(r["val_loss"]) for r in metrics(out) if r.get("val_loss")}
    assert sorted(val) == [2, 5], val  # validated after steps 3 and 6 (logged at global steps 2 and 5)
    for step, value in val.items():
        assert close(value, truth["val_losses"][step], 1e-4), (step, value, truth["val_losses"][step])
    assert sorted(os.listdir(os.path.join(out, "ckpt"))) == ["step=3.ckpt", "step=6.ckpt"]
    for data in reference_run.states().values():  # trainer.test() after fit, in the same replica processes
        tested = data["test_metrics"]
        assert close(tested["test_loss"], truth["val_losses"][-1], 1e-4), tested
        assert tested["test_samples"] == 40, "every replica evaluates the full loader; sync_dist does not multiply"
    assert "Epoch 0: 100%" in reference_run.output  # the progress bar ran (on the lowest replica)


@pytest.mark.slow
def test_killed_replica_mid_step_keeps_the_trajectory(tmp_path):
    # batch 16 x M 6 = 96 samples a step: 5 steps an epoch, so 7 steps also cross an epoch boundary
    # (exact mode, automatic optimization: bitwise equal to the exact single-process run)
    steps, batch_size = 7, 16
    truth = _single_process(steps=steps, batch_size=batch_size, exact=True)
    out = str(tmp_path)
    result = trainer_job(
        out,
        steps=steps,
        inject="kill:replica=1:step=2:phase=backward",
        extra=["--batch-size", str(batch_size), "--exact"],
    )
    assert result.returncode == 0, result.output[-4000:]
    assert_parameters(result, truth["state"], survivors=[0, 2], steps=steps, exact=True)
    rows = step_rows(out)
    assert sorted(rows) == list(range(steps))
    assert [int(rows[s]["epoch"]) for s in range(steps)] == [0] * 5 + [1] * 2
    assert [float(rows[s]["recover/live_replicas"]) for s in range(steps)] == [3, 3, 2, 2, 2, 2, 2]
    assert float(rows[2]["recover/recoveries"]) == 1
    assert float(rows[2]["recover/recomputed_microbatches"]) == M // REPLICAS  # the dead replica's quota, recomputed
    assert float(rows[2]["recover/recovery_seconds"]) > 0
    assert float(rows[2]["recover/generation"]) == 1
    for step, row in rows.items():
        assert close(float(row["recover/loss"]), truth["losses"][step]), (step, row)
    assert "step 2: recovered in" in result.output  # one clear line per event
    assert result.output.count("step 2: recovered in") == 1


def assert_rejoined(result, truth, steps: int, rejoiner: int, steps_per_epoch: int, exact: bool = False):
    """All replicas finished with the reference parameters; the restarted one resumed mid-run, in step."""
    states = assert_parameters(result, truth["state"], survivors=range(REPLICAS), steps=steps, exact=exact)
    rejoined = states[rejoiner]
    first = rejoined["steps"][0]["step"]
    assert 1 < first < steps, f"the restarted replica resumed mid-run (at step {first})"
    assert [s["step"] for s in rejoined["steps"]] == list(range(first, steps))
    assert [s["step"] for s in rejoined["stats"]] == list(range(first, steps)), "its first run_step is the group's"
    for r, data in states.items():
        # the fit loop, the StepLoader and Lightning's counters resume exactly at the step boundary
        for s in data["steps"]:
            assert s["position"] == s["step"] % steps_per_epoch, (r, s)
            assert s["epoch"] == s["step"] // steps_per_epoch, (r, s)
            assert s["batch_idx"] == s["position"], (r, s)
        assert data["batches_that_stepped"] == steps, (r, data["batches_that_stepped"])
        assert data["current_epoch"] == states[0]["current_epoch"]
    assert rejoined["stats"][-1]["computed"] == M // REPLICAS, "the rejoined replica takes its share"
    survivor = next(d for r, d in sorted(states.items()) if r != rejoiner)["stats"]
    assert [s["live_replicas"] for s in survivor][:2] == [3, 2]
    assert all(s["live_replicas"] == 3 for s in survivor if s["step"] >= first), "quotas include it after rejoin"
    rows = step_rows(result.out_dir)  # written by replica 0 (the lowest live one)
    assert sorted(rows) == list(range(steps))
    assert float(rows[1]["recover/live_replicas"]) == 2 and float(rows[steps - 1]["recover/live_replicas"]) == 3
    for step, row in rows.items():
        assert close(float(row["recover/loss"]), truth["losses"][step]), (step, row)
    return states


REJOIN_STEPS, REJOIN_BATCH = 9, 16  # 5 steps an epoch: the rejoined replica also crosses an epoch boundary


def _rejoin_job(tmp_path, cmd: list[str], rejoiner: int, inject: str):
    """Run ``cmd`` (with trainer_train.py's arguments last) holding the replicas before step 2 until the restarted
    ``rejoiner`` asked to join: step 2's commit admits it, so it is back before the run ends."""
    gate = str(tmp_path / "gate")
    cmd = [*cmd, "--hold", f"2:{gate}"]
    env = {"LIGHTNING_RECOVER_INJECT": inject}
    return run_gated_job(cmd, str(tmp_path / "job"), gate, lambda log: join_request(rejoiner) in log, env=env)


@pytest.mark.slow
def test_restarted_replica_rejoins_the_trainer_run(tmp_path):
    truth = _single_process(steps=REJOIN_STEPS, batch_size=REJOIN_BATCH, exact=True)
    cmd = [sys.executable, TRAINER_SCRIPT, str(tmp_path / "job"), "--replicas", str(REPLICAS)]
    cmd += ["--steps", str(REJOIN_STEPS), "--microbatches", str(M), "--heartbeat-timeout", "0.5"]
    cmd += ["--batch-size", str(REJOIN_BATCH), "--restarts", "1", "--exact"]
    result = _rejoin_job(tmp_path, cmd, 1, "kill:replica=1:step=1:phase=backward")
    assert result.returncode == 0, result.output[-4000:]
    assert "restarting replica 1 (1/1)" in result.output
    assert_rejoined(result, truth, REJOIN_STEPS, rejoiner=1, steps_per_epoch=5, exact=True)


@pytest.mark.slow
def test_torchrun_restarted_trainer_replica_rejoins(tmp_path):
    """`lightning-recover torchrun --max-restarts 1`: torchrun restarts the killed replica's worker (with
    torchrun's WORLD_SIZE=1 environment), and it rejoins the Trainer run with the live state."""
    truth = _single_process(steps=REJOIN_STEPS, batch_size=REJOIN_BATCH)
    out = str(tmp_path / "job")
    # A heartbeat timeout of 2 s: torchrun starts each worker as a new interpreter, and on 2 loaded cores one missed
    # 0.5 s of beats while another imported torch.
    cmd = [
        sys.executable,
        "-m",
        "lightning_recover.cli",
        "torchrun",
        "--replicas",
        "3",
        "--max-restarts",
        "1",
        "--heartbeat-timeout",
        "2",
        "--",
        TRAINER_SCRIPT,
        out,
        "--replicas",
        "3",
        "--steps",
        str(REJOIN_STEPS),
        "--microbatches",
        str(M),
        "--batch-size",
        str(REJOIN_BATCH),
        "--heartbeat-timeout",
        "2",
    ]
    result = _rejoin_job(tmp_path, cmd, 2, "kill:replica=2:step=1:phase=backward")
    assert result.returncode == 0, result.output[-4000:]
    assert_rejoined(result, truth, REJOIN_STEPS, rejoiner=2, steps_per_epoch=5)


@pytest.mark.slow
def test_resume_mid_epoch_while_the_writer_dies(tmp_path, reference_run, truth):
    """Resume from step 3 with 3 replicas; replica 0 (the writer, rank 0) is killed at step 4."""
    ckpt = os.path.join(reference_run.out_dir, "ckpt", "step=3.ckpt")
    out = str(tmp_path)
    result = trainer_job(
        out, inject="kill:replica=0:step=4:phase=backward", extra=["--resume", ckpt, "--ckpt-every", "5"]
    )
    assert result.returncode == 0, result.output[-4000:]
    assert "Restored all states from the checkpoint" in result.output
    assert_parameters(result, truth["state"], survivors=[1, 2])
    # the lowest survivor took over writing: the step-5 checkpoint exists and is complete
    assert os.listdir(os.path.join(out, "ckpt")) == ["step=5.ckpt"]
    rows = step_rows(out)
    assert float(rows[5]["recover/live_replicas"]) == 2
    assert close(float(rows[5]["recover/loss"]), truth["losses"][5])


@pytest.mark.slow
def test_elastic_resume_with_fewer_replicas(tmp_path, reference_run, truth):
    ckpt = os.path.join(reference_run.out_dir, "ckpt", "step=3.ckpt")
    out = str(tmp_path)
    result = trainer_job(out, replicas=2, extra=["--resume", ckpt])
    assert result.returncode == 0, result.output[-4000:]
    assert_parameters(result, truth["state"], survivors=[0, 1])
    rows = step_rows(out)
    assert sorted(rows) == [3, 4, 5]
    for step, row in rows.items():
        assert float(row["recover/live_replicas"]) == 2
        assert close(float(row["recover/loss"]), truth["losses"][step]), (step, row)


@pytest.mark.slow
def test_exact_resume_on_another_replica_count_is_bitwise(tmp_path):
    """Exact mode across a whole-job restart: 3 replicas checkpoint at step 3 (ModelCheckpoint), 2 replicas
    resume with fit(ckpt_path=...) and end bitwise equal to the exact single-process run; the checkpoint
    carried the fixed-point grid, so the first resumed step was not recalibrated (no redo)."""
    truth = _single_process(exact=True)
    first = str(tmp_path / "first")
    result = trainer_job(first, extra=["--exact", "--ckpt-every", "3"])
    assert_parameters(result, truth["state"], survivors=[0, 1, 2], exact=True)
    ckpt = os.path.join(first, "ckpt", "step=3.ckpt")
    result = trainer_job(str(tmp_path / "resumed"), replicas=2, extra=["--exact", "--resume", ckpt])
    assert result.returncode == 0, result.output[-4000:]
    assert_parameters(result, truth["state"], survivors=[0, 1], exact=True)
    history = result.states()[0]["stats"]
    assert [s["step"] for s in history] == [3, 4, 5] and history[0]["redone"] == 0, history


@pytest.mark.slow
def test_bf16_mixed(tmp_path, truth):
    out = str(tmp_path)
    result = trainer_job(out, replicas=2, steps=3, microbatches=4, extra=["--precision", "bf16-mixed", "--clip", "1.0"])
    assert result.returncode == 0, result.output[-4000:]
    states = result.states()
    assert sorted(states) == [0, 1]
    assert max_relative_difference(states[1]["state"], states[0]["state"]) == 0.0, "replicas stay identical"
    rows = step_rows(out)
    assert sorted(rows) == [0, 1, 2]
    bf16_truth = _single_process(steps=3, microbatches=4)
    for step, row in rows.items():
        loss = float(row["recover/loss"])
        assert math.isfinite(loss) and close(loss, bf16_truth["losses"][step], 5e-2), (step, loss)


# --------------------------------------------------------------------------- configuration, in process


def test_registered_with_the_trainer():
    from lightning.pytorch.strategies import StrategyRegistry

    assert "recover" in StrategyRegistry
    trainer = L.Trainer(strategy="recover", devices=3, accelerator="cpu", logger=False, enable_progress_bar=False)
    assert isinstance(trainer.strategy, RecoverTrainerStrategy)
    assert type(trainer.strategy.checkpoint_io).__name__ == "UringCheckpointIO"
    assert trainer.strategy.distributed_sampler_kwargs is None
    assert lightning_recover.RecoverTrainerStrategy is RecoverTrainerStrategy


class _Tiny(L.LightningModule):
    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.automatic_optimization = not manual

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader(n: int = 32) -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(n, 2)), batch_size=2)


def _trainer(**kwargs) -> L.Trainer:
    kwargs.setdefault("strategy", RecoverTrainerStrategy(microbatches=4))
    return L.Trainer(devices=2, accelerator="cpu", logger=False, enable_progress_bar=False, max_steps=1, **kwargs)


def test_accumulate_grad_batches_is_refused_with_a_hint():
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=2.*RecoverTrainerStrategy\(microbatches=M\)"):
        _trainer(accumulate_grad_batches=2).fit(_Tiny(), _loader())


def test_manual_optimization_is_refused_with_a_hint():
    with pytest.raises(ValueError, match="manual optimization.*HINT"):
        _trainer().fit(_Tiny(manual=True), _loader())


def test_fewer_microbatches_than_replicas_is_refused():
    with pytest.raises(ValueError, match="microbatches=1 is smaller than the number of replicas"):
        _trainer(strategy=RecoverTrainerStrategy(microbatches=1)).fit(_Tiny(), _loader())


def test_restarts_option_is_accepted_and_validated():
    assert RecoverTrainerStrategy(restarts=2).options.restarts == 2
    with pytest.raises(ValueError, match="restarts must be a non-negative integer"):
        RecoverTrainerStrategy(restarts=-1)


def test_a_replica_restarted_outside_fit_is_told_to_fit_first():
    strategy = RecoverTrainerStrategy()
    strategy.protocol_replica = SimpleNamespace(replica=1)
    trainer = SimpleNamespace(state=SimpleNamespace(fn=TrainerFn.TESTING))
    with pytest.raises(RuntimeError, match=r"replica 1 was restarted.*'test'.*HINT: call trainer.fit"):
        strategy._rejoin(trainer)


def test_bad_options_fail_at_construction():
    with pytest.raises(ValueError, match="heartbeat_timeout"):
        RecoverTrainerStrategy(heartbeat_interval=1.0, heartbeat_timeout=1.0)
    with pytest.raises(ValueError, match="quota"):
        RecoverTrainerStrategy(quota="fastest")


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(torch.randn(8, 2))


def test_iterable_dataset_and_unbatched_loaders_are_refused():
    with pytest.raises(TypeError, match="IterableDataset.*HINT: use a map-style dataset"):
        StepLoader(DataLoader(_Stream(), batch_size=2), 4, 0)
    with pytest.raises(ValueError, match="batch_size"):
        StepLoader(DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=None), 4, 0)


def test_step_loader_is_one_token_per_step_and_refuses_another_layout():
    loader = StepLoader(_loader(32), 4, 0)  # 16 microbatches of 2 -> 4 steps of M=4
    assert len(loader) == 4 and [t.position for t in loader] == [0, 1, 2, 3]
    state = loader.state_dict()
    StepLoader(_loader(32), 4, 0).load_state_dict(state)  # same layout: fine
    with pytest.raises(ValueError, match="microbatches: checkpoint 4 vs now 2.*same RecoverTrainerStrategy"):
        StepLoader(_loader(32), 2, 0).load_state_dict(state)


def test_step_loader_resumes_mid_epoch_once():
    loader = StepLoader(_loader(32), 4, 0, resume_position=lambda: 2)  # 4 steps an epoch
    assert [t.position for t in loader] == [0, 1, 2, 3]  # a fresh fit starts the epoch at 0
    loader.load_state_dict(loader.state_dict())  # Lightning restores loader states only on a resume
    assert [t.position for t in loader] == [2, 3]  # the rest of the resumed epoch
    assert [t.position for t in loader] == [0, 1, 2, 3]  # the next epoch is whole
