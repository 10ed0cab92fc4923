"""The protocol's logic with replicas as threads of this process, against a real coordinator.

Fast counterparts of tests/test_resilience.py (which runs real processes and signals): every
surviving replica must end equal to a single-process failure-free run that sums the same M
microbatches per step (float64, max relative difference <= 1e-9). See tests/inprocess.py for how
kill, hang and raise are acted out in threads.
"""

from __future__ import annotations

import threading

import pytest

from lightning_recover.errors import ReplicaExcludedError
from lightning_recover.protocol import Fault
from tests.inprocess import RUN_TIMEOUT, TOL, Cluster, max_relative_difference, reference

pytestmark = pytest.mark.timeout(60)


def run(replicas: int, steps: int, microbatches: int, faults=(), **kwargs) -> Cluster:
    with Cluster(replicas, steps=steps, microbatches=microbatches, faults=faults, **kwargs) as cluster:
        cluster.start().join()
    return cluster


def assert_matches_reference(cluster: Cluster, survivors: list[int]) -> None:
    assert cluster.survivors() == survivors, cluster.report()
    final = reference(cluster.M, cluster.steps)[-1]
    for r in survivors:
        slot = cluster.slot(r)
        assert slot.applied[-1] == cluster.steps - 1, slot.describe()
        diff = max_relative_difference(slot.state, final)
        assert diff <= TOL, f"replica {r} diverged from the failure-free run: max relative difference {diff}"


def live_per_step(cluster: Cluster, replica: int) -> list[int]:
    return [stats.live_replicas for stats in cluster.slot(replica).history]


def test_failure_free_run_equals_the_single_process_reference():
    cluster = run(3, steps=3, microbatches=6)
    assert_matches_reference(cluster, [0, 1, 2])
    assert live_per_step(cluster, 0) == [3, 3, 3]
    assert all(s.recoveries == 0 and s.computed == 2 for r in range(3) for s in cluster.slot(r).history)


SINGLE_PHASES = ["forward", "backward", "reduce", "commit", "optimizer"]


@pytest.mark.parametrize("replicas", [3, 4])
@pytest.mark.parametrize("phase", SINGLE_PHASES)
def test_killed_replica_in_each_phase(replicas, phase):
    M = 2 * replicas
    cluster = run(replicas, steps=3, microbatches=M, faults=[Fault("kill", 1, 1, phase)])
    survivors = [r for r in range(replicas) if r != 1]
    assert_matches_reference(cluster, survivors)
    assert cluster.slot(1).outcome == "killed" and cluster.slot(1).applied == ([0, 1] if phase == "optimizer" else [0])
    stats = cluster.slot(0).history
    assert sum(s.recoveries for s in stats) == 1, "exactly one in-step recovery"
    # The dead replica's quota (2 microbatches) is recomputed exactly once: in step 1, or in step 2
    # when it died after its done report (commit/optimizer: step 1 committed without a retry).
    recovered_in = 2 if phase in ("commit", "optimizer") else 1
    assert [s.step for s in stats if s.recoveries] == [recovered_in]
    assert sum(s.recomputed for r in survivors for s in cluster.slot(r).history) == 2
    assert live_per_step(cluster, 0)[-1] == replicas - 1


@pytest.mark.parametrize("kind", ["hang", "raise"])
def test_hung_or_raising_replica_in_the_reduce(kind):
    cluster = run(3, steps=3, microbatches=6, faults=[Fault(kind, 2, 1, "reduce")])
    assert_matches_reference(cluster, [0, 1])
    assert cluster.slot(2).outcome == {"hang": "hung", "raise": "raised"}[kind]
    assert live_per_step(cluster, 0) == [3, 2, 2]
    assert sum(s.recomputed for r in (0, 1) for s in cluster.slot(r).history) == 2


def test_hang_in_backward_is_revealed_by_the_heartbeat_monitor_only():
    # Nothing but the stale heartbeat tells the others: the harness never declares a hung replica dead.
    cluster = run(3, steps=3, microbatches=6, faults=[Fault("hang", 0, 1, "backward")])
    assert_matches_reference(cluster, [1, 2])
    assert live_per_step(cluster, 1) == [3, 2, 2]
    assert cluster.slot(1).history[1].recovery_seconds >= 0.4, "detected by the 0.5 s heartbeat timeout"


def test_two_deaths_in_one_step():
    cluster = run(4, steps=4, microbatches=8,
                  faults=[Fault("kill", 1, 2, "backward"), Fault("kill", 3, 2, "reduce")])
    assert_matches_reference(cluster, [0, 2])
    assert live_per_step(cluster, 0) == [4, 4, 2, 2]
    assert sum(s.recomputed for r in (0, 2) for s in cluster.slot(r).history) == 4


def test_cascade_death_during_recovery():
    # Replica 1 dies; while the survivors recompute its microbatches, replica 2 dies too.
    cluster = run(4, steps=3, microbatches=8,
                  faults=[Fault("kill", 1, 1, "backward"), Fault("kill", 2, 1, "recompute")])
    assert_matches_reference(cluster, [0, 3])
    assert cluster.slot(2).outcome == "killed", "the recompute fault fired"
    assert max(s.recoveries for s in cluster.slot(0).history) == 2, "two recoveries inside one step"
    assert live_per_step(cluster, 0) == [4, 2, 2]


def test_down_to_a_single_survivor():
    cluster = run(4, steps=5, microbatches=8,
                  faults=[Fault("kill", 0, 1, "reduce"), Fault("raise", 3, 2, "forward"), Fault("hang", 1, 3, "commit")])
    assert_matches_reference(cluster, [2])
    assert live_per_step(cluster, 2) == [4, 3, 2, 2, 1]
    assert cluster.slot(2).history[-1].computed == 8, "the last replica computes all M microbatches"


def test_throughput_quotas_keep_the_trajectory():
    cluster = run(3, steps=4, microbatches=6, faults=[Fault("kill", 2, 2, "backward")], quota="throughput")
    assert_matches_reference(cluster, [0, 1])
    assert sum(s.computed for r in (0, 1) for s in cluster.slot(r).history[-1:]) == 6


def test_falsely_suspected_replica_stops_and_never_applies_another_step():
    """Declared dead while alive (heartbeat running), then resumed: it must stop with
    ReplicaExcludedError, not rejoin silently; the others go on and equal the reference."""
    cluster = run(3, steps=4, microbatches=6, faults=[Fault("suspect", 1, 1, "backward")])
    victim = cluster.slot(1)
    assert victim.outcome == "excluded" and isinstance(victim.error, ReplicaExcludedError), cluster.report()
    assert victim.applied == [0], "no step applied after the suspicion"
    assert max_relative_difference(victim.state, reference(6, 4)[1]) <= TOL, "its state is the committed step 0"
    assert_matches_reference(cluster, [0, 2])
    assert live_per_step(cluster, 0) == [3, 2, 2, 2]


def test_replica_declared_dead_between_steps_never_diverges():
    # The suspicion lands before step 2 starts: the group may still commit step 2 with the victim
    # (every member reported done), but the victim can never apply a step the others did not.
    victim_id = 1

    def before_step(replica: int, step: int) -> None:
        if replica == victim_id and step == 2:
            cluster.declare_dead(victim_id, 1)

    with Cluster(3, steps=5, microbatches=6, before_step=before_step) as cluster:
        cluster.start().join()
    victim = cluster.slot(victim_id)
    assert victim.outcome == "excluded" and isinstance(victim.error, ReplicaExcludedError), cluster.report()
    assert victim.applied in ([0, 1], [0, 1, 2]), victim.describe()
    done = len(victim.applied)
    assert max_relative_difference(victim.state, reference(6, 5)[done]) <= TOL
    assert_matches_reference(cluster, [0, 2])


def test_restarted_replica_rejoins_with_live_state():
    """Replica 1 is killed in step 1; a new incarnation (another thread, other initial weights)
    asks to join, is admitted by the next commit, receives model + optimizer state and the step
    from a peer, and ends equal to the reference."""
    join_requested = threading.Event()

    def before_step(replica: int, step: int) -> None:
        # The survivors hold before step 2 until the joiner asked (its start() appends the request),
        # so step 2's commit admits it and it joins at step 3.
        if step == 2:
            assert join_requested.wait(RUN_TIMEOUT), "the restarted replica never asked to join"

    with Cluster(3, steps=6, microbatches=6, faults=[Fault("kill", 1, 1, "backward")],
                 before_step=before_step) as cluster:
        cluster.start()
        first = cluster.slot(1)
        cluster.wait(first.finished.is_set)
        assert first.outcome == "killed"
        joiner = cluster.spawn(1, incarnation=2, seed=1, on_started=lambda slot: join_requested.set())
        cluster.join()
    assert joiner.core.joining is False and joiner.rejoined_at == 3, joiner.describe()
    assert joiner.applied == [3, 4, 5]
    assert_matches_reference(cluster, [0, 1, 2])
    assert live_per_step(cluster, 0) == [3, 2, 2, 3, 3, 3]
    assert [s.computed for s in joiner.history] == [2, 2, 2], "the rejoined replica takes its share"
