"""Exact mode (``exact=True``): the fixed-point arithmetic, and bitwise-equal trajectories in process.

The arithmetic tests check the property exact mode rests on: the sum of the fixed-point terms is the
same bits over any partition of the microbatches and in any order, and rounds to within float32's
own error of a float64 reference. The cluster tests (replicas as threads against a real coordinator,
tests/inprocess.py) run float32 and bf16 models with AdamW and clipping through kills, hangs, a
rejoin and 2/3/4 replicas, and compare every survivor's parameters with ``torch.equal`` to the
failure-free 4-replica run. The multi-process counterparts are in tests/test_exact_jobs.py.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

from lightning_recover.errors import RecoverError
from lightning_recover.protocol import Fault, RecoverOptions, Replica
from lightning_recover.protocol.exact import (
    CHECKPOINT_KEY,
    EXACT_BITS,
    ExactAccumulator,
    ceil_log2,
    checkpoint_entries,
    mul_pow2_,
    restore_checkpoint_entries,
)
from tests.compare import max_relative_difference
from tests.inprocess import RUN_TIMEOUT, Cluster, loss_fn, make_model

pytestmark = pytest.mark.timeout(90)

M = 12
STEPS = 5


# ---------------------------------------------------------------------- the arithmetic
def _terms(dtype: torch.dtype, n: int = 4000, seed: int = 0) -> list[torch.Tensor]:
    """M microbatch 'gradients' over 6 orders of magnitude, as a float32/bf16 backward produces them."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-6, 0, n, dtype=torch.float64)
    return [(torch.randn(n, generator=gen, dtype=torch.float64) * scale).to(dtype) for _ in range(M)]


def _fixed_point_sum(terms: list[torch.Tensor], k: int, parts: list[list[int]], order: list[int]) -> torch.Tensor:
    """What the replicas do: each part accumulates its terms; the parts' sums are added in ``order``."""
    sums = []
    for part in parts:
        acc = torch.zeros(terms[0].numel(), dtype=torch.float64)
        for j in part:
            acc.add_(mul_pow2_(terms[j].clone(), k).round_())
        sums.append(acc)
    total = torch.zeros_like(sums[0])
    for i in order:
        total.add_(sums[i])
    return mul_pow2_(total, -k).div_(M)


def _grid(terms: list[torch.Tensor], headroom: int = 8) -> int:
    A = max(float(t.abs().max()) for t in terms)
    import math

    return EXACT_BITS - ceil_log2(M) - headroom - math.frexp(A)[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fixed_point_sum_is_the_same_bits_over_any_partition_and_order(dtype):
    terms = _terms(dtype)
    k = _grid(terms)
    first = _fixed_point_sum(terms, k, [list(range(M))], [0])
    rng = random.Random(1)
    for replicas in (2, 3, 4, 5, 12):
        ids = list(range(M))
        rng.shuffle(ids)
        parts = [ids[r::replicas] for r in range(replicas)]
        order = list(range(replicas))
        rng.shuffle(order)
        assert torch.equal(_fixed_point_sum(terms, k, parts, order), first)
    # The float path (sums in the gradient's dtype) does depend on the partition: what exact mode removes.
    floats = [sum(terms[j] for j in part) for part in ([0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11])]
    plain = sum(terms)
    assert not torch.equal(floats[0] + floats[1], plain), "the float sums happened to agree: pick other data"


def test_fixed_point_sum_is_as_accurate_as_float32_summation():
    """Against a float64 reference: normwise and relative to the tensor's largest element, exact mode's
    error (fixed point, then one rounding to float32) is no larger than float32 summation's."""
    terms = _terms(torch.float32, seed=3)
    ref = sum(t.double() for t in terms) / M
    exact = _fixed_point_sum(terms, _grid(terms), [list(range(M))], [0]).float().double()
    plain = (sum(terms) / M).double()

    def errors(x: torch.Tensor) -> tuple[float, float]:
        d = (x - ref).abs()
        return float(d.norm() / ref.norm()), float(d.max() / ref.abs().max())

    e_exact, e_plain = errors(exact), errors(plain)
    assert e_exact[0] <= e_plain[0] and e_exact[1] <= e_plain[1], (e_exact, e_plain)
    assert e_exact[1] <= 2.0**-24, "within one float32 rounding of the largest element"


def test_power_of_two_scaling_reaches_the_whole_float_range():
    t = torch.tensor([1e-30, 3e-38, 2.5e30], dtype=torch.float32)
    up = mul_pow2_(t.clone().double(), 150)
    assert torch.equal(mul_pow2_(up, -150), t.double())
    assert torch.equal(mul_pow2_(t.clone(), 60), t * 2.0**60)


def test_accumulator_refuses_a_grid_coarser_than_float32():
    with pytest.raises(ValueError, match="HINT"):
        ExactAccumulator(1 << 20)


def test_exact_with_a_sharded_replica_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="reduce-scatter.*HINT"):
        Replica(RecoverOptions(microbatches=4, exact=True), "127.0.0.1:1", 0, 2, lambda: [], replica_size=2)
    import lightning  # noqa: F401  (lightning first: lightning_recover registers its strategies on import)

    from lightning_recover.lightning.fabric import RecoverStrategy

    with pytest.raises(ValueError, match="FSDP2.*HINT"):
        RecoverStrategy(microbatches=4, exact=True, replica_size=2, shard="fsdp")


def test_exact_must_be_a_bool():
    with pytest.raises(ValueError, match="exact"):
        RecoverOptions(exact=1)


# ---------------------------------------------------------------------- trajectories (replicas as threads)
def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    # AdamW amplifies last-bit differences of the gradient: the test any summation-order noise fails.
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def spiky_loss(model: torch.nn.Module, step: int, j: int) -> torch.Tensor:
    """Step 3's gradients are 2**20 larger: beyond the grid's headroom, so steps 3 and 4 are redone."""
    loss = loss_fn(model, step, j)
    return loss * 2.0**20 if step == 3 else loss


def run_exact(replicas: int, dtype: torch.dtype, faults=(), **kwargs) -> Cluster:
    kwargs.setdefault("loss", spiky_loss)
    with Cluster(
        replicas,
        steps=STEPS,
        microbatches=M,
        faults=faults,
        exact=True,
        dtype=dtype,
        optimizer=adamw,
        clip=1.0,
        **kwargs,
    ) as cluster:
        cluster.start().join()
    return cluster


_BASELINE: dict[torch.dtype, Cluster] = {}


def baseline(dtype: torch.dtype) -> Cluster:
    """The failure-free 4-replica run every other run must equal bitwise."""
    if dtype not in _BASELINE:
        cluster = run_exact(4, dtype)
        assert cluster.survivors() == [0, 1, 2, 3], cluster.report()
        _BASELINE[dtype] = cluster
    return _BASELINE[dtype]


def assert_bitwise_equal(cluster: Cluster, survivors: list[int], dtype: torch.dtype) -> None:
    assert cluster.survivors() == survivors, cluster.report()
    want = baseline(dtype).slot(0).state
    for r in survivors:
        slot = cluster.slot(r)
        assert slot.applied[-1] == STEPS - 1, slot.describe()
        for name, value in want.items():
            assert torch.equal(slot.state[name], value), (
                f"replica {r}: {name} differs from the failure-free 4-replica run "
                f"(max relative {max_relative_difference({name: slot.state[name]}, {name: value}):.3g})"
            )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_failure_free_run_is_close_to_float64_and_redoes_only_the_calibration_and_the_spike(dtype):
    cluster = baseline(dtype)
    history = cluster.slot(0).history
    # Step 0 has no grid yet (one redo); step 3's 2**20 spike leaves the headroom upwards and step 4's
    # return to normal leaves it downwards (one redo each).
    assert [s.redone for s in history] == [1, 0, 0, 1, 1]
    losses = [s.loss for s in history]
    assert all(isinstance(v, float) for v in losses)
    # Every member computed the same losses (the slots are exact), and the same parameters.
    for r in (1, 2, 3):
        assert [s.loss for s in cluster.slot(r).history] == losses
        assert all(torch.equal(cluster.slot(r).state[k], v) for k, v in cluster.slot(0).state.items())
    # A float64 run of the same schedule (same AdamW, clipping, data): exact mode stays within the
    # dtype's own rounding of it.
    with Cluster(1, steps=STEPS, microbatches=M, optimizer=adamw, clip=1.0, loss=spiky_loss) as ref:
        ref.start().join()
    diff = max_relative_difference({k: v.double() for k, v in cluster.slot(0).state.items()}, ref.slot(0).state)
    assert diff < {torch.float32: 1e-4, torch.bfloat16: 5e-2}[dtype], diff


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("replicas", [2, 3])
def test_other_replica_counts_end_bitwise_equal(dtype, replicas):
    assert_bitwise_equal(run_exact(replicas, dtype), list(range(replicas)), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kills_and_a_hang_end_bitwise_equal(dtype):
    # A kill in the backward (its microbatches recomputed), a hang in the reduce (the heartbeat
    # reveals it), and a kill after its done report in the spike step, which is then redone
    # without it: three membership changes, one between an attempt and its redo.
    faults = [Fault("kill", 1, 1, "backward"), Fault("hang", 3, 2, "reduce"), Fault("kill", 2, 3, "commit")]
    cluster = run_exact(4, dtype, faults=faults)
    assert_bitwise_equal(cluster, [0], dtype)
    assert all(str(f) in cluster.slot(f.replica).fired_at for f in faults)
    history = cluster.slot(0).history
    assert [s.live_replicas for s in history] == [4, 3, 2, 1, 1]
    assert history[3].redone == 1


def test_kill_in_a_step_that_is_redone_ends_bitwise_equal():
    # Replica 2 dies in step 3's first reduce: the survivors recover, commit, then redo the step.
    faults = [Fault("kill", 2, 3, "reduce")]
    cluster = run_exact(3, torch.float32, faults=faults)
    assert_bitwise_equal(cluster, [0, 1], torch.float32)
    step3 = cluster.slot(0).history[3]
    assert step3.recoveries == 1 and step3.redone == 1, step3


def test_rejoined_replica_receives_the_grid_and_ends_bitwise_equal():
    join_requested = threading.Event()

    def before_step(replica: int, step: int) -> None:
        if step == 2:
            assert join_requested.wait(RUN_TIMEOUT), "the restarted replica never asked to join"

    with Cluster(
        3,
        steps=STEPS,
        microbatches=M,
        faults=[Fault("kill", 1, 1, "backward")],
        before_step=before_step,
        exact=True,
        dtype=torch.float32,
        optimizer=adamw,
        clip=1.0,
        loss=spiky_loss,
    ) as cluster:
        cluster.start()
        first = cluster.slot(1)
        cluster.wait(first.finished.is_set)
        joiner = cluster.spawn(1, incarnation=2, seed=1, on_started=lambda slot: join_requested.set())
        cluster.join()
    assert joiner.rejoined_at in (2, 3), joiner.describe()
    assert_bitwise_equal(cluster, [0, 1, 2], torch.float32)


def test_model_helpers_build_the_requested_dtype():
    assert next(make_model().to(torch.bfloat16).parameters()).dtype == torch.bfloat16


def test_checkpoint_entries_carry_the_grid_and_leave_the_users_remainder_clean():
    saving = ExactAccumulator(M)
    saving.load_state({"exponents": [30, None, -2]})
    checkpoint = {"model": {"w": torch.zeros(1)}, "step": 4, **checkpoint_entries(saving)}
    assert checkpoint_entries(None) == {}, "no entry without exact mode"
    resumed = ExactAccumulator(M)
    restore_checkpoint_entries(resumed, checkpoint)
    assert resumed.state() == {"exponents": [30, None, -2]}
    assert sorted(checkpoint) == ["model", "step"], "the entry is taken out of what the user gets back"
    plain = {"step": 4, **checkpoint_entries(saving)}
    restore_checkpoint_entries(None, plain)  # a job without exact mode drops the entry
    assert plain == {"step": 4}
    with pytest.raises(RecoverError, match="malformed"):
        restore_checkpoint_entries(ExactAccumulator(M), {CHECKPOINT_KEY: {"exponents": ["import os"]}})
